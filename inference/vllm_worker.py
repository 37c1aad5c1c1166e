"""Runs under vLLM's own interpreter (its venv, not eyas's): `python vllm_worker.py`, speaking engine_worker.py's
protocol on stdin/stdout.

Standalone on purpose (imports vLLM, never eyas): runtimes_vllm.py starts it with the interpreter vLLM is
installed in. One engine per worker, kept warm across requests; prompts one at a time (batch 1, as `eyas bench`
runs eyas), each timed around `LLM.generate`. A request gives token ids (`ids`), or chat `messages` that the
engine renders with its own tokenizer and template, as a server would; the row returns the prompt ids the
engine saw. Spec-decode counters are read before and after each prompt, so every request gets its own drafts,
accepted tokens and acceptance per position; with a head, every proposal's draft ids are kept too (the steps
eyas compares with its own drafts). The engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so it
can be observed; threads are bound as the job says before vLLM is imported.
"""

from __future__ import annotations

import json
import os
import time

from engine_worker import serve

SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"
# vLLM's speculative method for each speculators model type an eyas export writes: P-EAGLE is EAGLE-3 drafting
# every position from one forward, DFlash its own method (which drafts in parallel by itself)
METHODS = {"eagle3": {"method": "eagle3"}, "peagle": {"method": "eagle3", "parallel_drafting": True},
           "dflash": {"method": "dflash"}}


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


def start(job: dict):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job.get("kv_cache_gib", 2)))
    if job.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(job["threads"])
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{job['threads'] - 1}")
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    proposals: list = []
    spec = None
    if job.get("head"):
        record_proposals(proposals)
        with open(os.path.join(job["head"], "config.json")) as f:
            kind = json.load(f)["speculators_model_type"]
        spec = {"model": job["head"], "num_speculative_tokens": job["num_speculative_tokens"], **METHODS[kind]}
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], speculative_config=spec, dtype=job.get("dtype", "float32"),
              max_model_len=job["max_model_len"], seed=job.get("seed", 0),
              enforce_eager=job.get("enforce_eager", False), disable_log_stats=False, max_num_seqs=1)
    engine_start = time.perf_counter() - t0

    def answer(request: dict) -> dict:
        params = SamplingParams(max_tokens=request["max_new_tokens"], temperature=job["temperature"],
                                top_p=job["top_p"], top_k=job["top_k"] if job["top_k"] > 0 else -1,
                                seed=request["seed"], stop_token_ids=job["eos_token_ids"], ignore_eos=False)
        before = counters(llm)
        proposals.clear()
        t = time.perf_counter()
        if "messages" in request:  # rendered by the engine, as its chat endpoint would
            out = llm.chat(request["messages"], params, use_tqdm=False)
        else:
            out = llm.generate([TokensPrompt(prompt_token_ids=request["ids"])], params, use_tqdm=False)
        seconds = time.perf_counter() - t
        after = counters(llm)
        positions = [a - b for a, b in zip(after[PER_POSITION],
                                           before[PER_POSITION] or [0] * len(after[PER_POSITION]))]
        return {"tokens": list(out[0].outputs[0].token_ids), "time_s": seconds,
                "prompt_token_ids": list(out[0].prompt_token_ids),
                "drafts": after[SPEC_COUNTERS[0]] - before[SPEC_COUNTERS[0]],
                "draft_tokens": after[SPEC_COUNTERS[1]] - before[SPEC_COUNTERS[1]],
                "accepted_tokens": after[SPEC_COUNTERS[2]] - before[SPEC_COUNTERS[2]],
                "accepted_per_position": positions, "proposals": list(proposals) if spec else None}

    return answer, {"version": vllm.__version__, "engine_start_s": engine_start}


if __name__ == "__main__":
    serve(start)
