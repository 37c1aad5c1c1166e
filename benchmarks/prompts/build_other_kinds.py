"""Rebuild the ShareGPT rows of other-kinds.jsonl: prompts of other kinds than MT-bench for `eyas bench`.

    python benchmarks/prompts/build_other_kinds.py

other-kinds.jsonl holds 48 first turns in MT-bench's row format ({question_id, category, turns}):
- 24 written by hand (ids `hw-...`): translation, math, extraction to JSON/tables, code, QA over a given passage;
  this script keeps them as they are;
- 24 first user turns of ShareGPT conversations (ids `sharegpt-<row>`), picked by hand from rows 10000 and
  later (the demo and the weak head train on the first 4000): long documents to summarise, code to explain
  or fix, text to rewrite, and web search results to answer from (RAG). They are 1,400-5,700 characters
  long: contexts of 400-1,500 tokens, where a cycle's costs differ from MT-bench's short prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

PICKS = {  # ShareGPT row -> category
    11837: "long-document", 11861: "long-document", 12723: "long-document", 13439: "long-document",
    13443: "long-document", 13444: "long-document", 14480: "long-document", 15090: "long-document",
    13258: "code", 16228: "code", 17593: "code", 12696: "code", 11882: "code",
    10581: "rewriting", 10612: "rewriting", 11117: "rewriting", 11352: "rewriting", 13625: "rewriting",
    10413: "rag", 10937: "rag", 10993: "rag", 11049: "rag", 11100: "rag", 13457: "rag",
}
FILE = Path(__file__).with_name("other-kinds.jsonl")


def main() -> None:
    from eyas.data.sources import load_conversations

    convs, _ = load_conversations("sharegpt")
    kept = [json.loads(line) for line in FILE.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [r for r in kept if str(r["question_id"]).startswith("hw-")]
    for index, category in PICKS.items():
        first = convs[index]["messages"][0]
        assert first["role"] == "user", index
        rows.append({"question_id": f"sharegpt-{index}", "category": category, "turns": [first["content"].strip()]})
    FILE.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    print(f"{FILE}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
