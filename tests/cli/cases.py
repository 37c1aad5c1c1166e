"""The bad-input corpus: one row per kind of mistake a user makes, as data.

A case is the command line (placeholders: {t} the case's own folder, {target} {head} {head1} {chats} {examples}
{checkpoint} {questions} {config} {run} the session's assets), what the user has on disk before (`setup`),
the exit status expected (2: refused with one line; argparse's own errors also exit 2) and a regex the
message must match: it names the problem (the file, line, key or option) and, where there is one, the fix.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file


@dataclass(frozen=True)
class Case:
    id: str
    argv: tuple[str, ...]
    match: str
    setup: Callable[[Path, dict], None] | None = None
    status: int = 2
    env: dict = field(default_factory=dict)


# ---- what the user has on disk ----------------------------------------------------------------------------
def files(**contents: str | bytes) -> Callable[[Path, dict], None]:
    """Files under the case folder: name (`__` for `/`) -> text or bytes."""
    def make(t: Path, a: dict) -> None:
        for name, body in contents.items():
            path = t / name.replace("__", "/")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(body if isinstance(body, bytes) else body.encode())
    return make


def copy(asset: str, name: str, edit: Callable[[Path], None] | None = None) -> Callable[[Path, dict], None]:
    """A copy of an asset folder under the case folder as `name`, then `edit(copy)`."""
    def make(t: Path, a: dict) -> None:
        shutil.copytree(a[asset], t / name)
        if edit:
            edit(t / name)
    return make


def both(*steps: Callable[[Path, dict], None]) -> Callable[[Path, dict], None]:
    def make(t: Path, a: dict) -> None:
        for s in steps:
            s(t, a)
    return make


def json_edit(name: str, fn: Callable[[dict], object]) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        raw = json.loads((folder / name).read_text())
        raw = fn(raw) or raw
        (folder / name).write_text(json.dumps(raw))
    return edit


def set_key(**kv):
    return lambda raw: {**raw, **kv}


def weights_edit(fn: Callable[[dict], None], name: str = "model.safetensors") -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        state = load_file(folder / name)
        fn(state)
        save_file(state, folder / name)
    return edit


def truncate(name: str, keep: float = 0.5) -> Callable[[Path], None]:
    def edit(folder: Path) -> None:
        data = (folder / name).read_bytes()
        (folder / name).write_bytes(data[: int(len(data) * keep)])
    return edit


def remove(name: str) -> Callable[[Path], None]:
    return lambda folder: (folder / name).unlink()


def poison(key: str, value: float):
    def fn(state):
        state[key] = state[key].clone()
        state[key].view(-1)[0] = value
    return fn


def d2t_past_vocab(state):
    state["d2t"] = state["d2t"].clone()
    state["d2t"][-1] = 10_000


def no_chat_template(folder: Path) -> None:
    cfg = folder / "tokenizer_config.json"
    raw = json.loads(cfg.read_text())
    raw.pop("chat_template", None)
    cfg.write_text(json.dumps(raw))
    (folder / "chat_template.jinja").unlink(missing_ok=True)


def user_folder(name: str) -> Callable[[Path, dict], None]:
    return files(**{f"{name}__notes.txt": "my own notes", f"{name}__data__keep.csv": "a,b\n1,2\n"})


def chats(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


ROW = {"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3 w4"}]}
SHAREGPT_ROW = {"conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3 w4"}]}
OTHER_COLUMNS = "question,answer\nw1 w2,w3 w4\nw5,w6\n"


def parquet(t: Path, a: dict) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["w1 w2"], "answer": ["w3 w4"]}), t / "rows.parquet")


def resumed_output_with_bad_middle(t: Path, a: dict) -> None:
    rows = [{"id": f"{i}", "messages": ROW["messages"]} for i in range(3)]
    lines = [json.dumps(r) for r in rows]
    lines[1] = lines[1][:20]
    (t / "out.jsonl").write_text("\n".join(lines) + "\n")


def cache_edit(fn: Callable[[Path], None]) -> Callable[[Path, dict], None]:
    """A hidden-state cache written by `eyas data cache-hidden` into {t}/hidden, then damaged by `fn`."""
    def make(t: Path, a: dict) -> None:
        import datasets

        from eyas.data.hidden_cache import cache_hidden
        from eyas.models import Target

        target = Target.load(str(a["target"]))
        cache_hidden(target, datasets.load_from_disk(str(a["examples"] / "train")), t / "hidden", (1, 2), "bf16", 8)
        fn(t / "hidden")
    return make


def truncate_first_shard(folder: Path) -> None:
    shard = sorted(folder.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])


def first_shard_gone(folder: Path) -> None:
    sorted(folder.glob("*.safetensors"))[0].unlink()


# ---- the argv of each command, with the asset placeholders -----------------------------------------------
GEN = ("generate", "--target", "{target}", "--head", "{head}", "--prompt", "w1 w2", "--max-new-tokens", "2",
       "--total-tokens", "4", "--depth", "2")
CHAT = ("chat", "--target", "{target}", "--head", "{head}", "--max-new-tokens", "2")
BENCH = ("bench", "--target", "{target}", "--head", "{head}", "--questions", "{questions}", "--out",
         "{t}/report.json", "--max-new-tokens", "2", "--total-tokens", "4", "--depth", "2")
CHECK = ("check-served", "--target", "{target}", "--head", "{head}", "--limit", "1")
EXPORT = ("export", "{head}", "--out", "{t}/out")
PREP = ("data", "prepare", "--target", "{target}", "--source", "{chats}", "--out", "{t}/ex")
REGEN = ("data", "regenerate", "--target", "{target}", "--source", "{chats}", "--out", "{t}/out.jsonl",
         "--limit", "2", "--max-new-tokens", "2")
VOCAB = ("data", "vocab", "--target", "{target}", "--examples", "{examples}", "--size", "50", "--out",
         "{t}/vocab.safetensors")
CACHE = ("data", "cache-hidden", "--target", "{target}", "--examples", "{examples}", "--out", "{t}/hidden")
TRAIN = ("train", "--config", "{config}", "target.spec={target}", "data.source={chats}", "output_dir={t}/run",
         "schedule.total_steps=1")


def with_(base: tuple[str, ...], *extra: str, drop: tuple[str, ...] = ()) -> tuple[str, ...]:
    """`base` with the options in `drop` (and their values) removed, then `extra` appended; an extra option
    already in base replaces its value."""
    out, i = [], 0
    replaced = {extra[j] for j in range(len(extra)) if extra[j].startswith("--")}
    while i < len(base):
        if base[i] in drop or base[i] in replaced:
            i += 2
            continue
        out.append(base[i])
        i += 1
    return (*out, *extra)


def swap(base: tuple[str, ...], old: str, new: str) -> tuple[str, ...]:
    return tuple(new if a == old else a for a in base)


USAGE = r"usage: eyas"
TARGET_DIR = "{t}/tgt"
HEAD_DIR = "{t}/hd"

CASES: list[Case] = [
    # -- the command line itself ------------------------------------------------------------------------
    Case("no-command", (), r"required: COMMAND"),
    Case("unknown-command", ("frobnicate",), r"invalid choice: 'frobnicate'"),
    Case("data-no-subcommand", ("data",), r"required: DATA_COMMAND"),
    # -- generate: option values ------------------------------------------------------------------------
    Case("generate-no-prompt", with_(GEN, drop=("--prompt",)), r"required: --prompt"),
    Case("generate-max-new-tokens-0", with_(GEN, "--max-new-tokens", "0"), r"--max-new-tokens.*at least 1"),
    Case("generate-max-new-tokens-negative", with_(GEN, "--max-new-tokens", "-3"), r"--max-new-tokens.*at least 1"),
    Case("generate-max-new-tokens-text", with_(GEN, "--max-new-tokens", "many"), r"--max-new-tokens.*'many'"),
    Case("generate-temperature-negative", with_(GEN, "--temperature", "-1"), r"--temperature.*>= 0"),
    Case("generate-top-p-0", with_(GEN, "--top-p", "0"), r"--top-p.*\(0, 1\]"),
    Case("generate-top-p-above-1", with_(GEN, "--top-p", "1.5"), r"--top-p.*\(0, 1\]"),
    Case("generate-top-k-negative", with_(GEN, "--top-k", "-1"), r"--top-k.*>= 0"),
    Case("generate-min-p-above-1", with_(GEN, "--min-p", "2"), r"--min-p.*\[0, 1\]"),
    Case("generate-repetition-penalty-0", with_(GEN, "--repetition-penalty", "0"), r"--repetition-penalty.*> 0"),
    Case("generate-depth-0", with_(GEN, "--depth", "0"), r"--depth.*at least 1"),
    Case("generate-total-tokens-0", with_(GEN, "--total-tokens", "0"), r"--total-tokens.*at least 1.*auto"),
    Case("generate-total-tokens-text", with_(GEN, "--total-tokens", "lots"), r"--total-tokens.*auto"),
    Case("generate-tree-top-k-0", with_(GEN, "--tree-top-k", "0"), r"--tree-top-k.*at least 1"),
    Case("generate-lookup-negative", with_(GEN, "--lookup", "-2"), r"--lookup.*>= 0"),
    Case("generate-paths-not-json", with_(GEN, "--tree", "static", "--paths", "[[0],[1"), r"--paths.*JSON.*\[\[0\]"),
    Case("generate-paths-not-lists", with_(GEN, "--tree", "static", "--paths", "[1, 2]"),
         r"--paths.*list of paths"),
    Case("generate-paths-negative", with_(GEN, "--tree", "static", "--paths", "[[0],[-1]]"),
         r"--paths.*non-negative"),
    Case("generate-seed-text", with_(GEN, "--seed", "x"), r"--seed.*invalid int"),
    Case("generate-dtype-unknown", with_(GEN, "--dtype", "fp64"), r"--dtype.*invalid choice"),
    Case("generate-device-unknown", with_(GEN, "--device", "tpu"), r"unknown device 'tpu'.*cpu"),
    Case("generate-device-cuda-absent", with_(GEN, "--device", "cuda"), r"no CUDA GPU.*--device cpu"),
    # -- generate: the target -----------------------------------------------------------------------------
    Case("target-missing", swap(GEN, "{target}", "{t}/nowhere"), r"nowhere.*(neither|does not exist)"),
    Case("target-empty-folder", swap(GEN, "{target}", TARGET_DIR), r"tgt has no config\.json",
         files(**{"tgt__.keep": ""})),
    Case("target-no-weights", swap(GEN, "{target}", TARGET_DIR), r"tgt.*(no|without).*weights",
         copy("target", "tgt", remove("model.safetensors"))),
    Case("target-config-not-json", swap(GEN, "{target}", TARGET_DIR), r"tgt.*config\.json.*(JSON|parse)",
         copy("target", "tgt", lambda f: (f / "config.json").write_text("{ not json"))),
    Case("target-unknown-model-type", swap(GEN, "{target}", TARGET_DIR), r"model_type 'frobnet'",
         copy("target", "tgt", json_edit("config.json", set_key(model_type="frobnet")))),
    Case("target-weights-truncated", swap(GEN, "{target}", TARGET_DIR), r"tgt.*model\.safetensors.*(truncated|corrupt)",
         copy("target", "tgt", truncate("model.safetensors"))),
    Case("target-weights-garbage", swap(GEN, "{target}", TARGET_DIR),
         r"tgt/model\.safetensors is truncated or corrupt.*header",
         copy("target", "tgt", lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 64))),
    Case("target-gguf-missing", swap(GEN, "{target}", "{t}/model.gguf"), r"model\.gguf does not exist"),
    Case("target-no-tokenizer", swap(GEN, "{target}", TARGET_DIR), r"tokenizer",
         copy("target", "tgt", lambda f: [p.unlink() for p in f.glob("tokenizer*")])),
    # -- generate: the head -------------------------------------------------------------------------------
    Case("head-missing", swap(GEN, "{head}", "{t}/nohead"), r"nohead.*(not a head folder|does not exist)"),
    Case("head-empty-folder", swap(GEN, "{head}", HEAD_DIR), r"hd is not a head folder.*config\.json",
         files(**{"hd__.keep": ""})),
    Case("head-config-not-json", swap(GEN, "{head}", HEAD_DIR), r"hd/config\.json is not valid JSON",
         copy("head", "hd", lambda f: (f / "config.json").write_text("{"))),
    Case("head-config-a-list", swap(GEN, "{head}", HEAD_DIR), r"hd/config\.json must hold a JSON object",
         copy("head", "hd", lambda f: (f / "config.json").write_text("[1, 2]"))),
    Case("head-unknown-layout", swap(GEN, "{head}", HEAD_DIR), r"unknown head layout",
         copy("head", "hd", json_edit("config.json", lambda r: {"architectures": ["FrobModel"]}))),
    Case("head-no-weights", swap(GEN, "{head}", HEAD_DIR), r"hd has config\.json but no model\.safetensors",
         copy("head", "hd", remove("model.safetensors"))),
    Case("head-weights-truncated", swap(GEN, "{head}", HEAD_DIR), r"hd.*model\.safetensors.*(truncated|corrupt)",
         copy("head", "hd", truncate("model.safetensors"))),
    Case("head-config-shape-mismatch", swap(GEN, "{head}", HEAD_DIR), r"hd.*(shape|do not fit)",
         copy("head", "hd", json_edit("config.json", set_key(intermediate_size=96)))),
    Case("head-for-another-target", swap(GEN, "{head}", HEAD_DIR), r"(hidden size|hidden_size).*(48|64)",
         copy("head", "hd", json_edit("config.json", lambda r: r["target"].update(hidden_size=48)))),
    Case("head-other-tokenizer", swap(GEN, "{head}", HEAD_DIR), r"tokenizer",
         copy("head", "hd", json_edit("config.json", lambda r: r["target"].update(tokenizer_fingerprint="sha256:0")))),
    Case("head-d2t-past-vocab", swap(GEN, "{head}", HEAD_DIR), r"d2t.*(past|outside|beyond).*320",
         copy("head", "hd", weights_edit(d2t_past_vocab))),
    Case("head-nan-weights", swap(GEN, "{head}", HEAD_DIR), r"fc\.weight.*(NaN|non-finite)",
         copy("head", "hd", weights_edit(poison("fc.weight", float("nan"))))),
    Case("head-inf-weights", swap(GEN, "{head}", HEAD_DIR), r"norm\.weight.*(inf|non-finite)",
         copy("head", "hd", weights_edit(poison("norm.weight", float("inf"))))),
    Case("head-unknown-head-type", swap(GEN, "{head}", HEAD_DIR), r"head_type 'eagle9'",
         copy("head", "hd", json_edit("config.json", set_key(head_type="eagle9")))),
    Case("head-is-a-file", swap(GEN, "{head}", "{t}/head.txt"), r"head\.txt.*(not a head folder|is a file)",
         files(**{"head.txt": "hello"})),
    # -- chat ----------------------------------------------------------------------------------------------
    Case("chat-max-new-tokens-0", with_(CHAT, "--max-new-tokens", "0"), r"--max-new-tokens.*at least 1"),
    Case("chat-head-missing", swap(CHAT, "{head}", "{t}/nohead"), r"nohead"),
    Case("chat-no-chat-template", swap(CHAT, "{target}", TARGET_DIR), r"no chat template.*generate --raw",
         copy("target", "tgt", no_chat_template)),
    # -- check-served --------------------------------------------------------------------------------------
    Case("check-served-limit-0", with_(CHECK, "--limit", "0"), r"--limit.*at least 1"),
    Case("check-served-draft-tokens-0", with_(CHECK, "--draft-tokens", "0"), r"--draft-tokens.*at least 1"),
    Case("check-served-tolerance-above-1", with_(CHECK, "--tolerance", "2"), r"--tolerance.*\[0, 1\]"),
    # -- bench ---------------------------------------------------------------------------------------------
    Case("bench-no-out", with_(BENCH, drop=("--out",)), r"required: --out"),
    Case("bench-questions-missing", with_(BENCH, "--questions", "{t}/q.jsonl"), r"q\.jsonl"),
    Case("bench-questions-empty", with_(BENCH, "--questions", "{t}/q.jsonl"), r"q\.jsonl.*(empty|no questions)",
         files(**{"q.jsonl": ""})),
    Case("bench-questions-bad-json", with_(BENCH, "--questions", "{t}/q.jsonl"), r"q\.jsonl:2",
         files(**{"q.jsonl": '{"turns": ["w1"]}\n{"turns": [\n'})),
    Case("bench-questions-no-turns", with_(BENCH, "--questions", "{t}/q.jsonl"), r"q\.jsonl:1.*(turns|prompt)",
         files(**{"q.jsonl": '{"question": "w1"}\n'})),
    Case("bench-questions-binary", with_(BENCH, "--questions", "{t}/q.jsonl"), r"q\.jsonl.*(UTF-8|text)",
         files(**{"q.jsonl": b"\x00\x01\x02\xff\xfe"})),
    Case("bench-limit-negative", with_(BENCH, "--limit", "-1"), r"--limit.*>= 0"),
    Case("bench-per-category-0", with_(BENCH, "--per-category", "0"), r"--per-category.*at least 1"),
    Case("bench-repeats-0", with_(BENCH, "--repeats", "0"), r"--repeats.*at least 1"),
    Case("bench-threads-0", with_(BENCH, "--threads", "0"), r"--threads.*at least 1"),
    Case("bench-out-below-a-file", with_(BENCH, "--out", "{t}/taken/report.json"), r"taken is a file",
         files(taken="x")),
    Case("bench-out-is-a-folder", with_(BENCH, "--out", "{t}/reports"), r"reports is a folder",
         files(**{"reports__.keep": ""})),
    Case("bench-no-generate-alone", with_(BENCH, "--no-generate"), r"without transformers generate.*--eyas-plain"),
    Case("bench-vllm-without-python", with_(BENCH, "--vllm"), r"--vllm-python.*EYAS_VLLM_PYTHON",
         env={"EYAS_VLLM_PYTHON": ""}),
    Case("bench-prompt-lookup-0", with_(BENCH, "--prompt-lookup", "0"), r"--prompt-lookup.*at least 1"),
    # -- export --------------------------------------------------------------------------------------------
    Case("export-source-missing", swap(EXPORT, "{head}", "{t}/nohead"), r"nohead is neither a head folder"),
    Case("export-out-holds-user-files", EXPORT, r"out already holds files eyas did not write.*--force",
         user_folder("out")),
    Case("export-out-is-a-file", EXPORT, r"out exists and is not a folder", files(out="my file")),
    Case("export-out-below-a-file", swap(EXPORT, "{t}/out", "{t}/taken/out"), r"taken is a file", files(taken="x")),
    Case("export-format-unknown", (*EXPORT, "--format", "onnx"), r"--format.*invalid choice"),
    Case("export-nan-head", swap(EXPORT, "{head}", HEAD_DIR), r"fc\.weight.*(NaN|non-finite)",
         copy("head", "hd", weights_edit(poison("fc.weight", float("nan"))))),
    Case("export-truncated-head", swap(EXPORT, "{head}", HEAD_DIR), r"model\.safetensors.*(truncated|corrupt)",
         copy("head", "hd", truncate("model.safetensors", 0.9))),
    Case("export-eagle-needs-target", (*swap(EXPORT, "{head}", "{head1}"), "--format", "eagle"), r"--target"),
    Case("export-eagle3-as-eagle1", (*EXPORT, "--format", "eagle", "--target", "{target}"), r"eagle3|EAGLE-3"),
    Case("export-target-missing", (*EXPORT, "--target", "{t}/nowhere"), r"nowhere"),
    Case("export-not-a-checkpoint", swap(EXPORT, "{head}", "{t}/ckpt"), r"ckpt is neither a head folder",
         files(**{"ckpt__trainer.json": "{}"})),
    # -- data prepare --------------------------------------------------------------------------------------
    Case("prepare-source-missing", swap(PREP, "{chats}", "{t}/none.jsonl"), r"none\.jsonl.*neither"),
    Case("prepare-source-empty", swap(PREP, "{chats}", "{t}/c.jsonl"), r"c\.jsonl is empty", files(**{"c.jsonl": ""})),
    Case("prepare-source-utf16", swap(PREP, "{chats}", "{t}/c.jsonl"), r"c\.jsonl.*UTF-16.*UTF-8",
         files(**{"c.jsonl": chats([ROW]).encode("utf-16")})),
    Case("prepare-source-binary", swap(PREP, "{chats}", "{t}/c.jsonl"), r"c\.jsonl.*NUL",
         files(**{"c.jsonl": b"\x89PNG\x00\x00\x1a"})),
    Case("prepare-source-latin1", swap(PREP, "{chats}", "{t}/c.jsonl"), r"c\.jsonl:2.*not UTF-8",
         files(**{"c.jsonl": chats([ROW]).encode() + json.dumps({"messages": [{"role": "user", "content": "café"}]},
                                                               ensure_ascii=False).encode("latin-1") + b"\n"})),
    # a malformed line or a cut-off tail among good rows is skipped and counted in the summary; with no good row:
    Case("prepare-source-only-bad-json-lines", swap(PREP, "{chats}", "{t}/c.jsonl"), r"c\.jsonl.*no usable rows",
         files(**{"c.jsonl": '{"messages": [\n{"messages": [{"role"\n'})),
    Case("prepare-source-truncated-array", swap(PREP, "{chats}", "{t}/c.json"), r"c\.json holds no rows.*cut off",
         files(**{"c.json": '[{"messages": ['})),
    Case("prepare-source-no-conversation", swap(PREP, "{chats}", "{t}/c.jsonl"), r"c\.jsonl.*text.*--fields",
         files(**{"c.jsonl": chats([{"text": "hello"}, {"text": "world"}])})),
    Case("prepare-source-csv-other-columns", swap(PREP, "{chats}", "{t}/c.csv"), r"question, answer.*--fields",
         files(**{"c.csv": OTHER_COLUMNS})),
    Case("prepare-source-parquet-other-columns", swap(PREP, "{chats}", "{t}/rows.parquet"),
         r"question, answer.*--fields", parquet),
    Case("prepare-source-folder-without-data", swap(PREP, "{chats}", "{t}/d"), r"holds no \.json",
         files(**{"d__readme.txt": "x"})),
    Case("prepare-source-mixed-formats", swap(PREP, "{chats}", "{t}/d"), r"mixes file formats",
         files(**{"d__a.jsonl": chats([ROW]), "d__b.csv": OTHER_COLUMNS})),
    Case("prepare-source-corrupt-parquet", swap(PREP, "{chats}", "{t}/c.parquet"), r"c\.parquet",
         files(**{"c.parquet": b"PAR1 this is not parquet"})),
    Case("prepare-fields-syntax", (*PREP, "--fields", "conversation"), r"--fields.*conversation=COL"),
    Case("prepare-fields-unknown-key", (*PREP, "--fields", "chat=messages"), r"--fields.*chat.*conversation, role"),
    Case("prepare-out-holds-user-files", PREP, r"ex already holds files eyas did not write.*--force",
         user_folder("ex")),
    Case("prepare-out-is-a-file", PREP, r"ex exists and is not a folder", files(ex="mine")),
    Case("prepare-out-below-a-file", swap(PREP, "{t}/ex", "{t}/taken/ex"), r"taken is a file", files(taken="x")),
    Case("prepare-max-length-0", (*PREP, "--max-length", "0"), r"--max-length.*at least 1"),
    Case("prepare-held-out-negative", (*PREP, "--held-out", "-1"), r"--held-out.*>= 0"),
    Case("prepare-held-out-everything", (*PREP, "--held-out", "1000"), r"held.out.*1000.*(rows|examples)"),
    Case("prepare-limit-negative", (*PREP, "--limit", "-5"), r"--limit.*>= 0"),
    Case("prepare-num-proc-0", (*PREP, "--num-proc", "0"), r"--num-proc.*at least 1"),
    Case("prepare-target-missing", swap(PREP, "{target}", "{t}/nowhere"), r"nowhere"),
    Case("prepare-target-no-tokenizer", swap(PREP, "{target}", TARGET_DIR), r"tgt.*tokenizer",
         copy("target", "tgt", lambda f: [p.unlink() for p in f.glob("tokenizer*")])),
    # -- data regenerate -----------------------------------------------------------------------------------
    Case("regenerate-batch-size-0", (*REGEN, "--batch-size", "0"), r"--batch-size.*at least 1"),
    Case("regenerate-max-new-tokens-0", with_(REGEN, "--max-new-tokens", "0"), r"--max-new-tokens.*at least 1"),
    Case("regenerate-max-length-0", (*REGEN, "--max-length", "0"), r"--max-length.*at least 1"),
    Case("regenerate-max-turns-0", (*REGEN, "--max-turns", "0"), r"--max-turns.*at least 1"),
    Case("regenerate-temperature-negative", (*REGEN, "--temperature", "-0.5"), r"--temperature.*>= 0"),
    Case("regenerate-top-p-0", (*REGEN, "--top-p", "0"), r"--top-p.*\(0, 1\]"),
    Case("regenerate-limit-negative", with_(REGEN, "--limit", "-1"), r"--limit.*>= 0"),
    Case("regenerate-threads-0", (*REGEN, "--threads", "0"), r"--threads.*at least 1"),
    Case("regenerate-shard-examples-0", (*REGEN, "--shard-examples", "0"), r"--shard-examples.*at least 1"),
    Case("regenerate-part-out-of-range", (*REGEN, "--part", "3/2"), r"part 3/2.*0\.\.N-1"),
    Case("regenerate-part-syntax", (*REGEN, "--part", "half"), r"K/N"),
    Case("regenerate-out-is-a-folder", swap(REGEN, "{t}/out.jsonl", "{t}/outdir"), r"outdir is a folder",
         files(**{"outdir__mine.txt": "mine"})),
    Case("regenerate-out-below-a-file", swap(REGEN, "{t}/out.jsonl", "{t}/taken/out.jsonl"), r"taken is a file",
         files(taken="x")),
    Case("regenerate-cache-below-a-file", (*REGEN, "--cache-hidden", "{t}/taken/hidden"), r"taken is a file",
         files(taken="x")),
    Case("regenerate-source-empty", swap(REGEN, "{chats}", "{t}/c.jsonl"), r"c\.jsonl is empty",
         files(**{"c.jsonl": ""})),
    Case("regenerate-output-corrupt-middle", REGEN, r"out\.jsonl:2", resumed_output_with_bad_middle),
    Case("regenerate-layers-text", (*REGEN, "--cache-hidden", "{t}/h", "--layers", "1,two"),
         r"--layers.*comma-separated.*'1,two'"),
    Case("regenerate-layers-past-target", (*REGEN, "--cache-hidden", "{t}/h", "--layers", "1,9"),
         r"layer.*9.*(4 layers|0\.\.3)"),
    Case("regenerate-server-bad-url", (*REGEN, "--server", "not a url"), r"--server.*(URL|http)"),
    Case("regenerate-timeout-0", (*REGEN, "--timeout", "0"), r"--timeout.*> 0"),
    Case("regenerate-retries-negative", (*REGEN, "--retries", "-1"), r"--retries.*>= 0"),
    # -- data vocab ----------------------------------------------------------------------------------------
    Case("vocab-examples-missing", swap(VOCAB, "{examples}", "{t}/noex"), r"noex/train does not exist.*prepare"),
    Case("vocab-examples-not-prepared", swap(VOCAB, "{examples}", "{t}/ex"), r"ex/train.*(prepare|not)",
         files(**{"ex__train__junk.txt": "x"})),
    Case("vocab-size-0", with_(VOCAB, "--size", "0"), r"--size.*at least 1"),
    Case("vocab-size-past-vocab", with_(VOCAB, "--size", "5000"), r"5000.*320"),
    Case("vocab-out-is-a-folder", swap(VOCAB, "{t}/vocab.safetensors", "{t}/vdir"), r"vdir is a folder",
         files(**{"vdir__mine.txt": "mine"})),
    Case("vocab-out-below-a-file", swap(VOCAB, "{t}/vocab.safetensors", "{t}/taken/v.safetensors"),
         r"taken is a file", files(taken="x")),
    Case("vocab-out-corrupt", VOCAB, r"vocab\.safetensors is not a readable vocab map.*delete it",
         files(**{"vocab.safetensors": b"\x10\x00\x00\x00\x00\x00\x00\x00{broken"})),
    Case("vocab-out-foreign-safetensors", VOCAB, r"vocab\.safetensors is not an eyas vocab map",
         lambda t, a: save_file({"x": torch.zeros(2)}, t / "vocab.safetensors")),
    Case("train-vocab-cache-corrupt", (*TRAIN, "head.draft_vocab_size=50", "data.vocab_cache={t}/v.safetensors"),
         r"v\.safetensors is not a readable vocab map", files(**{"v.safetensors": b"garbage"})),
    # -- data cache-hidden ---------------------------------------------------------------------------------
    Case("cache-examples-missing", swap(CACHE, "{examples}", "{t}/noex"), r"noex/train does not exist.*prepare"),
    Case("cache-split-unknown", (*CACHE, "--split", "test"), r"--split.*invalid choice"),
    Case("cache-out-below-a-file", swap(CACHE, "{t}/hidden", "{t}/taken/hidden"), r"taken is a file",
         files(taken="x")),
    Case("cache-out-is-a-file", CACHE, r"hidden.*(is a file|not a folder)", files(hidden="mine")),
    Case("cache-layers-text", (*CACHE, "--layers", "a,b"), r"--layers.*comma-separated"),
    Case("cache-layers-past-target", (*CACHE, "--layers", "1,50"), r"layer.*50.*(4 layers|0\.\.3)"),
    Case("cache-batch-size-0", (*CACHE, "--batch-size", "0"), r"--batch-size.*at least 1"),
    Case("train-offline-truncated-shard", (*TRAIN, "data.hidden_states=offline", "data.cache_dir={t}/hidden"),
         r"shard .*hidden/.*safetensors is missing, truncated or corrupt.*cache-hidden",
         cache_edit(truncate_first_shard)),
    Case("train-offline-shard-gone", (*TRAIN, "data.hidden_states=offline", "data.cache_dir={t}/hidden"),
         r"shard .*hidden/.*safetensors is missing.*cache-hidden", cache_edit(first_shard_gone)),
    # -- train ---------------------------------------------------------------------------------------------
    Case("train-no-config", ("train",), r"required: --config"),
    Case("train-config-missing", swap(TRAIN, "{config}", "{t}/run.yaml"), r"run\.yaml does not exist"),
    Case("train-config-a-list", swap(TRAIN, "{config}", "{t}/run.yaml"), r"run\.yaml.*mapping.*list",
         files(**{"run.yaml": "- a\n- b\n"})),
    Case("train-config-a-scalar", swap(TRAIN, "{config}", "{t}/run.yaml"), r"run\.yaml.*mapping.*(str|int)",
         files(**{"run.yaml": "42\n"})),
    Case("train-config-invalid-yaml", swap(TRAIN, "{config}", "{t}/run.yaml"),
         r"run\.yaml:2:1: run\.yaml is not valid YAML",
         files(**{"run.yaml": "a: [1,\n"})),
    Case("train-config-section-a-list", swap(TRAIN, "{config}", "{t}/run.yaml"),
         r"override 'data\.source=.*': 'data' is not a section",
         files(**{"run.yaml": "data: [1, 2]\n"})),
    Case("train-unknown-key", (*TRAIN, "optim.lrate=1"), r"unknown config key 'optim\.lrate'.*lr"),
    Case("train-override-no-equals", (*TRAIN, "optim.lr"), r"'optim\.lr' is not key=value"),
    Case("train-override-into-a-value", (*TRAIN, "optim.lr.x=1"), r"'lr' is not a section"),
    Case("train-override-bad-number", (*TRAIN, "optim.lr=fast"), r"optim\.lr must be a number.*'fast'"),
    Case("train-override-list-section", (*TRAIN, "head.fused_layer_ids.0=1"), r"head\.fused_layer_ids must be a list"),
    Case("train-head-type-unknown", (*TRAIN, "head.type=eagle9"),
         r"head\.type 'eagle9' is not one of eagle1, eagle3, peagle, dflash"),
    Case("train-batch-size-0", (*TRAIN, "batch.size=0"), r"batch\.size.*must be >= 1"),
    Case("train-total-steps-negative", (*TRAIN, "schedule.total_steps=-1"), r"schedule\.total_steps must be >= 1"),
    Case("train-output-below-a-file", swap(TRAIN, "output_dir={t}/run", "output_dir={t}/taken/run"),
         r"taken is a file", files(taken="x")),
    Case("train-output-is-a-file", TRAIN, r"run.*(is a file|not a folder)", files(run="x")),
    Case("train-target-missing", swap(TRAIN, "target.spec={target}", "target.spec={t}/nowhere"), r"nowhere"),
    Case("train-source-empty", swap(TRAIN, "data.source={chats}", "data.source={t}/c.jsonl"), r"c\.jsonl is empty",
         files(**{"c.jsonl": ""})),
    Case("train-resume-not-a-checkpoint", (*TRAIN, "checkpoint.resume={t}/ckpt"), r"ckpt is not a complete checkpoint",
         files(**{"ckpt__junk.txt": "x"})),
    Case("train-resume-none-with-checkpoints", swap((*TRAIN, "checkpoint.resume=none"), "output_dir={t}/run",
                                                   "output_dir={t}/r"), r"already has checkpoints.*resume=auto",
         copy("run", "r")),
    Case("train-offline-without-cache", (*TRAIN, "data.hidden_states=offline"), r"cache_dir"),
    Case("train-fused-layer-past-target", (*TRAIN, "head.fused_layer_ids=[1,9]"), r"(layer|fused).*9.*4"),
    # -- demo ----------------------------------------------------------------------------------------------
    Case("demo-questions-missing", ("demo", "--questions", "{t}/q.jsonl"), r"q\.jsonl"),
    Case("demo-config-missing", ("demo", "--questions", "{questions}", "--config", "{t}/none.yaml"),
         r"none\.yaml not found"),
    Case("demo-max-new-tokens-0", ("demo", "--max-new-tokens", "0"), r"--max-new-tokens.*at least 1"),
    Case("demo-distill-conversations-negative", ("demo", "--distill-conversations", "-1"),
         r"--distill-conversations.*>= 0"),
]
