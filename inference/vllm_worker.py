"""Runs under vLLM's own interpreter (its venv, not eyas's): `python vllm_worker.py JOB.json OUT.json`.

Standalone on purpose (imports vLLM, never eyas): runtimes_vllm.py writes the job, starts this script with
the interpreter vLLM is installed in and reads the result. One engine per job, prompts one at a time (batch
1, as `eyas bench` runs eyas), each timed around `LLM.generate`; spec-decode counters are read before and
after each prompt, so every question gets its own drafts, accepted tokens and acceptance per position.
With `record_drafts`, the draft token ids of every proposal are kept too (for tests comparing them with
eyas's own drafts). The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so it can be
observed; threads are bound as the job says before vLLM is imported.
"""

from __future__ import annotations

import json
import os
import sys
import time

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def counters(llm) -> dict:
    """The spec-decode counters now: {name: value}, PER_POSITION: [value per draft position]."""
    out: dict = {name: 0 for name in SPEC_COUNTERS}
    out[PER_POSITION] = []
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            out[metric.name] = metric.value
        elif metric.name == PER_POSITION:
            out[PER_POSITION] = list(metric.values)
    return out


def record_proposals(sink: list) -> None:
    """Keep every proposal's draft token ids ([batch, k] from SpecDecodeBaseProposer.propose)."""
    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

    propose = SpecDecodeBaseProposer.propose

    def recording(self, *args, **kwargs):
        drafts = propose(self, *args, **kwargs)
        sink.extend(drafts.tolist())
        return drafts

    SpecDecodeBaseProposer.propose = recording


def main(job_path: str, out_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 2)))
    if job.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(job["threads"])
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    proposals: list = []
    if job.get("record_drafts"):
        record_proposals(proposals)
    spec = None
    if job.get("head"):
        spec = {"model": job["head"], "method": "eagle3", "num_speculative_tokens": job["num_speculative_tokens"]}
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], speculative_config=spec, dtype=job.get("dtype", "float32"),
              max_model_len=job["max_model_len"], seed=job.get("seed", 0),
              enforce_eager=job.get("enforce_eager", False), disable_log_stats=False, max_num_seqs=1)
    engine_start = time.perf_counter() - t0

    def params(n: int, seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, temperature=job["temperature"], top_p=job["top_p"],
                              top_k=job["top_k"] if job["top_k"] > 0 else -1, seed=seed,
                              stop_token_ids=job["eos_token_ids"], ignore_eos=False)

    def generate(ids: list[int], n: int, seed: int):
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params(n, seed), use_tqdm=False)
        return list(out[0].outputs[0].token_ids), time.perf_counter() - t

    if job["prompts"]:
        generate(job["prompts"][0], job.get("warmup_tokens", 8), job.get("seed", 0))  # first-call costs
    rows = []
    for i, ids in enumerate(job["prompts"]):
        before, first = counters(llm), len(proposals)
        tokens, seconds = generate(ids, job["max_new_tokens"], job.get("seed", 0) + i)
        after = counters(llm)
        positions = [a - b for a, b in zip(after[PER_POSITION],
                                           before[PER_POSITION] or [0] * len(after[PER_POSITION]))]
        rows.append({"tokens": tokens, "time_s": seconds,
                     "drafts": after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]],
                     "draft_tokens": after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]],
                     "accepted_tokens": after[SPEC_COUNTERS[2]] - before[SPEC_COUNTERS[2]],
                     "accepted_per_position": positions,
                     **({"proposals": proposals[first:]} if job.get("record_drafts") else {})})
    with open(out_path, "w") as f:
        json.dump({"vllm_version": vllm.__version__, "engine_start_s": engine_start, "rows": rows}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
