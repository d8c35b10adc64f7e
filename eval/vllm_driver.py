"""Run requests through vLLM and record what it counts: ``python eval/vllm_driver.py JOB.json OUT.json``.

Started by :mod:`eval.online` with the vLLM venv's interpreter (never imported by the project's
``.venv``: vLLM pins its own torch and transformers), so it uses the standard library and vLLM only.
JOB holds the target folder, the exported drafter (or null for the base model), K, the engine
settings and the requests as prompt token ids; OUT gets, per request, the output token ids, the
speculative-decoding counters (differences of ``LLM.get_metrics()`` around the request, which
run one at a time) and the wall time, plus the engine's load time. Written to a temporary name
and renamed, so a crash never leaves a half file.
"""

from __future__ import annotations

import json
import os
import sys
import time

COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def read_counters(llm, steps: int) -> dict:
    """The global counters now: {name: value}, the per-position vector as a list of K values."""
    out = {name: 0 for name in COUNTERS}
    out[PER_POS] = [0] * steps
    for m in llm.get_metrics():
        if m.name in COUNTERS:
            out[m.name] = int(m.value)
        elif m.name == PER_POS:
            vals = list(getattr(m, "values", []))
            out[PER_POS] = [int(v) for v in vals] + [0] * (steps - len(vals))
    return out


def run(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    steps = int(job["steps"])
    kwargs = dict(model=job["target"], dtype=job.get("dtype", "float32"), max_model_len=int(job["max_model_len"]),
                  enforce_eager=True, disable_log_stats=False, seed=0,
                  kv_cache_memory_bytes=int(job.get("kv_cache_bytes", 1 << 30)))
    if job.get("drafter"):
        kwargs["speculative_config"] = {"method": "eagle3", "model": job["drafter"], "num_speculative_tokens": steps}
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    load_s = time.perf_counter() - t0
    results = []
    for req in job["requests"]:
        temperature = float(job.get("temperature", 0.0))
        seeded = {"seed": int(job.get("seed", 0))} if temperature > 0 else {}  # sampled runs reproduce
        params = SamplingParams(temperature=temperature, max_tokens=int(req["max_tokens"]), ignore_eos=False,
                                **seeded)
        before = read_counters(llm, steps) if job.get("drafter") else None
        t1 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": req["prompt_token_ids"]}], params, use_tqdm=False)
        wall = time.perf_counter() - t1
        row = {"id": req["id"], "output_token_ids": list(out[0].outputs[0].token_ids),
               "finish_reason": out[0].outputs[0].finish_reason, "seconds": wall}
        if before is not None:
            after = read_counters(llm, steps)
            row["num_drafts"] = after[COUNTERS[0]] - before[COUNTERS[0]]
            row["num_draft_tokens"] = after[COUNTERS[1]] - before[COUNTERS[1]]
            row["num_accepted_tokens"] = after[COUNTERS[2]] - before[COUNTERS[2]]
            row["num_accepted_tokens_per_pos"] = [a - b for a, b in zip(after[PER_POS], before[PER_POS], strict=True)]
        results.append(row)
        print(f"[vllm_driver] {req['id']}: {len(row['output_token_ids'])} tokens in {wall:.2f} s", flush=True)
    import vllm

    return {"vllm_version": vllm.__version__, "load_seconds": load_s, "requests": results}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage: python eval/vllm_driver.py JOB.json OUT.json", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        job = json.load(f)
    result = run(job)
    tmp = f"{argv[2]}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[2])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
