"""Runs under SGLang's own interpreter (its venv, not eyas's): `python sglang_worker.py`, speaking
engine_worker.py's protocol on stdin/stdout, as vllm_worker.py does for vLLM.

One SGLang `Engine` per worker (offline, in this process's control), kept warm across requests, prompts one at
a time. With a head (an export in the sglang layout) it drafts a chain of `num_speculative_tokens` per step
(EAGLE-3, top-k 1: what eyas-chain-k and vLLM verify). SGLang reports its own counters per request in
`meta_info` (verify steps, proposed and accepted drafts, steps by accepted drafts); no proposal is recorded.
"""

from __future__ import annotations

import os
import time

from engine_worker import serve


def start(job: dict):
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if job.get("threads"):
        os.environ["OMP_NUM_THREADS"] = str(job["threads"])
    import sglang

    spec = {}
    if job.get("head"):
        k = job["num_speculative_tokens"]
        spec = dict(speculative_algorithm="EAGLE3", speculative_draft_model_path=job["head"],
                    speculative_num_steps=k, speculative_eagle_topk=1, speculative_num_draft_tokens=k + 1)
    t0 = time.perf_counter()
    engine = sglang.Engine(model_path=job["model"], dtype=job.get("dtype", "float32"), device="cpu",
                           random_seed=job.get("seed", 0), context_length=job["max_model_len"],
                           disable_cuda_graph=True, max_running_requests=1, **spec)
    engine_start = time.perf_counter() - t0

    def answer(request: dict) -> dict:
        params = {"max_new_tokens": request["max_new_tokens"], "temperature": job["temperature"],
                  "top_p": job["top_p"], "top_k": job["top_k"] if job["top_k"] > 0 else -1,
                  "stop_token_ids": job["eos_token_ids"], "sampling_seed": request["seed"]}
        ids = request.get("ids")
        if ids is None:  # rendered with the engine's own tokenizer and template, as its chat endpoint would
            ids = engine.tokenizer_manager.tokenizer.apply_chat_template(request["messages"], tokenize=True,
                                                                         add_generation_prompt=True)
        t = time.perf_counter()
        out = engine.generate(input_ids=list(ids), sampling_params=params)
        seconds = time.perf_counter() - t
        meta = out["meta_info"]
        steps = meta.get("spec_correct_drafts_histogram") or []  # steps[j]: steps that accepted j drafts
        return {"tokens": list(out["output_ids"]), "time_s": seconds, "prompt_token_ids": list(ids),
                "drafts": meta.get("spec_verify_ct", 0), "draft_tokens": meta.get("spec_num_proposed_drafts", 0),
                "accepted_tokens": meta.get("spec_num_correct_drafts", 0),
                "accepted_per_position": [sum(steps[j + 1:]) for j in range(len(steps) - 1)], "proposals": None}

    return answer, {"version": sglang.__version__, "engine_start_s": engine_start}


if __name__ == "__main__":
    serve(start)
