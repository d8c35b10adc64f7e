"""SGLang behind the line protocol: ``python -m redraft.engines.sglang_driver`` (started by :mod:`redraft.engines.sglang`).

Runs under the engine's interpreter (the SGLang CPU venv of ``make sglang-cpu-venv``, or a GPU machine's python
with SGLang installed) and imports the standard library, SGLang, torch and safetensors (SGLang dependencies),
:mod:`redraft.engines.driver_protocol` and :mod:`redraft.engines.request` only. Always a subprocess, never in-process:
when one of its scheduler processes dies, SGLang kills its parent, and that must be this driver, not redraft.

Settings (the protocol's first line): ``engine_kwargs`` (``sglang.Engine`` arguments, already complete),
``capture_dir`` (where ``capture`` writes its files), ``aux_width`` (the width a capture must have),
``sglang_version`` (the version the caller's stand-in
was written for, or null). Commands:

- ``capture``: ``requests`` of ``{"id", "input_ids", "top_k"}``; each prompt prefilled once with its aux
  hidden states and top-k prompt log-probabilities, written to ``capture_dir/<id>.safetensors``
  (:func:`parse_capture_output`); rows ``{"id", "path", "tokens"}``.
- ``generate``: ``requests`` of :class:`~redraft.engines.request.TokenRequest` fields, ``sequential``; rows
  ``{"id", "output_token_ids", "finish_reason", "seconds"}`` plus SGLang's own per-request speculative
  counters from ``meta_info`` when the engine speculates (:func:`spec_counters`).

Every engine argument and response field was checked against the sglang 0.5.23 wheel (paths relative to
``python/`` in sgl-project/sglang):

- ``Engine.async_generate``/``generate`` arguments: ``sglang/srt/entrypoints/engine.py``; sampling keys:
  ``sglang/srt/sampling/sampling_params.py``.
- Response: ``output_ids`` and ``meta_info`` keys ``hidden_states``, ``input_top_logprobs``,
  ``output_top_logprobs``, ``prompt_tokens``, ``cached_tokens``, ``finish_reason`` and the ``spec_*`` counters
  (``sglang/srt/managers/scheduler_components/batch_result_processor.py``). Prefill hidden states are one
  ``[T][n_aux * H]`` list per request (``.cpu().clone().tolist()``: there is no tensor form in 0.5.23).
  ``input_top_logprobs`` starts with ``None`` and drops the last prompt row, whose distribution is the first
  output token's (``scheduler_components/logprob_result_processor.py``); input log-probabilities are a plain
  log-softmax of the logits (``sglang/srt/layers/logprob_processor.py``), output ones too when greedy.
- Memory: as Python floats those lists cost about 32 bytes per value (688 KB per token at Kimi-K2.5's
  3 x 7168), and ``Engine.generate`` with a batch gathers every response before returning. Capture therefore
  sends one ``Engine.async_generate`` per prompt, concurrently on the engine's own event loop (the scheduler
  batches them as usual), and turns each response into tensors on disk as soon as it arrives.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from redraft.engines.driver_protocol import Progress, driver_main
from redraft.engines.request import TokenRequest, sglang_sampling_params

SPEC_KEYS = ("spec_verify_ct", "spec_num_correct_drafts", "spec_num_proposed_drafts", "spec_accept_length",
             "spec_correct_drafts_histogram")


# ------------------------------------------------------------------------------------------ requests


def capture_request(ids: Sequence[int], teacher_k: int) -> dict[str, Any]:
    """``Engine.async_generate`` arguments for one sequence: a 1-token greedy step with prompt logprobs.

    logprob_start_len=0 matters twice: it asks for top-k rows at every prompt position, and SGLang prunes
    returned hidden states to the same start. Greedy keeps the last row a plain log-softmax.
    """
    return {
        "input_ids": [int(t) for t in ids],
        "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
        "return_hidden_states": True,
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": int(teacher_k),
    }


# ------------------------------------------------------------------------------------------ responses


def _meta(output: Mapping[str, Any], index: int | str | None = None) -> Mapping[str, Any]:
    meta = output.get("meta_info")
    if not isinstance(meta, Mapping):
        where = "" if index is None else f" #{index}"
        raise ValueError(f"SGLang response{where} has no meta_info dict (keys: {sorted(output)})")
    return meta


def _prompt_hidden_rows(meta: Mapping[str, Any]) -> list:
    hs = meta.get("hidden_states")
    if not hs:
        raise ValueError(
            "SGLang response has no meta_info['hidden_states']: the engine must be started with "
            "enable_return_aux_hidden_states=True and the request sent with return_hidden_states=True"
        )
    rows = hs[0]  # the prefill block; decode steps (none with max_new_tokens=1) would follow
    if not rows or not isinstance(rows[0], (list, tuple)):
        raise ValueError(
            "meta_info['hidden_states'][0] is not a [T][hidden] block; was return_hidden_states='last' used?"
        )
    return rows


def check_response(index: int | str, prompt: Sequence[int], output: Mapping[str, Any]) -> None:
    """Fail loudly when SGLang returned features for fewer tokens than it was given.

    Radix-cache hits and chunked prefill both shorten the returned hidden states silently.
    """
    meta = _meta(output, index)
    n = len(prompt)
    cached = meta.get("cached_tokens") or 0
    if cached:
        raise ValueError(
            f"sample #{index}: SGLang served {cached} of {n} prompt tokens from the radix cache, so their hidden "
            "states are missing; start the engine with disable_radix_cache=True"
        )
    if meta.get("prompt_tokens", n) != n:
        raise ValueError(f"sample #{index}: sent {n} tokens but SGLang counted prompt_tokens={meta['prompt_tokens']}")
    got = len(_prompt_hidden_rows(meta))
    if got != n:
        raise ValueError(
            f"sample #{index}: SGLang returned hidden states for {got} of {n} prompt tokens; chunked prefill drops "
            "middle chunks (use chunked_prefill_size=-1 or >= max_length) and radix-cache hits drop the prefix"
        )
    top = meta.get("input_top_logprobs")
    if top is not None and len(top) != n:
        raise ValueError(f"sample #{index}: {len(top)} input_top_logprobs rows for {n} prompt tokens")


def _topk_row(row: Any, k: int, where: str) -> tuple[list[int], list[float]]:
    """One position's (logprob, token_id, text) entries -> the k best ids and logprobs, descending."""
    if not row or len(row) < k:
        raise ValueError(f"{where}: {0 if not row else len(row)} top logprobs, need teacher k={k}")
    entries = sorted(((float(e[0]), int(e[1])) for e in row), key=lambda e: -e[0])[:k]
    return [e[1] for e in entries], [e[0] for e in entries]


def parse_capture_output(output: Mapping[str, Any], teacher_k: int, *, aux_width: int | None = None) -> dict[str, Any]:
    """One SGLang capture response -> ``aux_hidden`` [T, n_aux*H] float32, ``topk_ids`` [T, K] int64 and
    ``topk_logprobs`` [T, K] float32 tensors.

    Teacher row t (the distribution after reading tokens 0..t) is ``input_top_logprobs[t + 1]`` for
    t < T-1 (row 0 is SGLang's placeholder None), and ``output_top_logprobs[0]`` for the last token.
    """
    import torch

    meta = _meta(output)
    rows = _prompt_hidden_rows(meta)
    aux = torch.tensor(rows, dtype=torch.float32)
    if aux.dim() != 2:
        raise ValueError(f"hidden states are not a [T][hidden] block (shape {tuple(aux.shape)})")
    n = aux.shape[0]
    if aux_width is not None and aux.shape[1] != aux_width:
        raise ValueError(
            f"SGLang returned hidden states of width {aux.shape[1]}, expected {aux_width} (n_aux * hidden_size); "
            "is the engine returning last-layer states instead of the aux capture, or one layer short?"
        )
    top_in = meta.get("input_top_logprobs")
    top_out = meta.get("output_top_logprobs")
    if top_in is None or not top_out:
        raise ValueError(
            "SGLang response lacks input_top_logprobs/output_top_logprobs: send return_logprob=True, "
            "logprob_start_len=0 and top_logprobs_num=K"
        )
    if len(top_in) != n:
        raise ValueError(f"{len(top_in)} input_top_logprobs rows for {n} hidden-state rows")
    ids, lps = [], []
    for t in range(n):
        row = top_in[t + 1] if t + 1 < n else top_out[0]
        where = f"teacher row {t}" + (" (output_top_logprobs[0])" if t + 1 >= n else "")
        i, lp = _topk_row(row, teacher_k, where)
        ids.append(i)
        lps.append(lp)
    return {"aux_hidden": aux, "topk_ids": torch.tensor(ids, dtype=torch.int64),
            "topk_logprobs": torch.tensor(lps, dtype=torch.float32)}


def parse_generate_output(output: Mapping[str, Any]) -> list[int]:
    """New token ids of one generation, ending with the stop id when one was matched."""
    ids = [int(t) for t in output.get("output_ids") or []]
    finish = _meta(output).get("finish_reason")
    matched = finish.get("matched") if isinstance(finish, Mapping) else None
    if isinstance(matched, int) and not isinstance(matched, bool) and (not ids or ids[-1] != matched):
        ids.append(matched)
    return ids


def spec_counters(meta: Mapping[str, Any], steps: int | None = None) -> dict[str, Any]:
    """SGLang's own per-request speculative counters, and the same in the vocabulary redraft compares across
    engines: ``num_drafts`` (verify rounds), ``num_accepted_tokens`` (accepted drafts, the bonus token not
    counted), ``num_accepted_tokens_per_pos`` (rounds that accepted at least j + 1 drafts, from SGLang's
    histogram of drafts accepted per round)."""
    hist = [int(c) for c in meta.get("spec_correct_drafts_histogram") or []]
    steps = max(int(steps or 0), len(hist) - 1)  # unknown steps (a server's answer): the histogram's length
    per_pos = [sum(hist[j + 1:]) for j in range(steps)]
    out = {key: meta.get(key) for key in SPEC_KEYS}
    out.update(num_drafts=int(meta.get("spec_verify_ct") or 0),
               num_accepted_tokens=int(meta.get("spec_num_correct_drafts") or 0),
               num_draft_tokens=int(meta.get("spec_num_proposed_drafts") or 0),
               num_accepted_tokens_per_pos=per_pos)
    return out


# ------------------------------------------------------------------------------------------ the driver


class Driver:
    """One loaded ``sglang.Engine``."""

    def __init__(self, settings: dict[str, Any]) -> None:
        import sglang

        wanted = settings.get("sglang_version")
        if wanted and sglang.__version__ != wanted:
            raise RuntimeError(f"SGLang {sglang.__version__} is installed in {sys.prefix}; redraft's CPU stand-in "
                               f"for its kernels was written for SGLang {wanted} only")
        self.kwargs = dict(settings["engine_kwargs"])
        self.capture_dir = settings.get("capture_dir")
        self.aux_width = settings.get("aux_width")  # n_aux * hidden: a capture one layer short is refused
        self.steps = int(self.kwargs.get("speculative_num_steps") or 0)
        self.speculative = bool(self.kwargs.get("speculative_algorithm")) and not self.kwargs.get(
            "enable_return_aux_hidden_states")
        t0 = time.perf_counter()
        self.engine = sglang.Engine(**self.kwargs)
        self.load_seconds = time.perf_counter() - t0
        self.version = sglang.__version__

    def ready_fields(self) -> dict[str, Any]:
        """Version, load time, and the request limit the scheduler enforces as SGLang reports it: the effective
        one from its internal state (``effective_max_running_requests_per_dp``: 48 when speculating and nothing
        was asked, SGLang's cap), the server argument beside it (None when nothing was asked)."""
        info = self.engine.get_server_info()
        info = info if isinstance(info, Mapping) else {}
        states = info.get("internal_states") or [{}]
        state = states[0] if isinstance(states[0], Mapping) else {}
        return {"sglang_version": self.version, "load_seconds": self.load_seconds,
                "max_running_requests": state.get("effective_max_running_requests_per_dp",
                                                  info.get("max_running_requests")),
                "max_running_requests_arg": info.get("max_running_requests"),
                "max_total_num_tokens": info.get("max_total_num_tokens")}

    def close(self) -> None:
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()

    def run(self, cmd: dict[str, Any], progress: Progress | None = None) -> list[dict[str, Any]]:
        if cmd.get("op") == "capture":
            return self.capture(cmd["requests"], progress)
        if cmd.get("op") == "generate":
            return self.generate(cmd["requests"], bool(cmd.get("sequential")), progress)
        raise ValueError(f"unknown op {cmd.get('op')!r}")

    def capture(self, requests: list[dict[str, Any]], progress: Progress | None) -> list[dict[str, Any]]:
        """Every prompt sent at once (the scheduler batches them); each response written to its file as it
        arrives, so that only one response's float lists are alive per scheduler output."""
        from safetensors.torch import save_file

        if not self.capture_dir:
            raise ValueError("capture: this engine was started without a capture_dir")
        engine, done, width = self.engine, [0], self.aux_width

        async def one(req: dict[str, Any]) -> dict[str, Any]:
            ids = req["input_ids"]
            output = await engine.async_generate(**capture_request(ids, int(req["top_k"])))
            check_response(req["id"], ids, output)
            tensors = parse_capture_output(output, int(req["top_k"]), aux_width=width)
            path = os.path.join(self.capture_dir, f"{req['id']}.safetensors")
            import torch

            save_file({**tensors, "input_ids": torch.tensor(ids, dtype=torch.int64)}, path + ".tmp")
            os.replace(path + ".tmp", path)
            done[0] += 1
            if progress is not None:
                progress(done[0], len(requests))
            return {"id": req["id"], "path": path, "tokens": len(ids)}

        async def every() -> list[dict[str, Any]]:
            return list(await asyncio.gather(*(one(r) for r in requests)))

        return engine.loop.run_until_complete(every())

    def generate(self, requests: list[dict[str, Any]], sequential: bool,
                 progress: Progress | None) -> list[dict[str, Any]]:
        """Rows in request order. sequential: one request at a time (its own wall time); else all at once, each
        row with the batch's wall time. Speculative counters are per request either way (SGLang keeps them in
        each request's meta_info)."""
        reqs = [TokenRequest(**r) for r in requests]
        if sequential:
            rows = []
            for i, req in enumerate(reqs):
                t0 = time.perf_counter()
                out = self.engine.generate(input_ids=req.prompt_token_ids, sampling_params=sglang_sampling_params(req))
                rows.append(self._row(req, out, time.perf_counter() - t0))
                if progress is not None:
                    progress(i + 1, len(reqs))
            return rows
        t0 = time.perf_counter()
        outs = self.engine.generate(input_ids=[r.prompt_token_ids for r in reqs],
                                    sampling_params=[sglang_sampling_params(r) for r in reqs])
        outs = [outs] if isinstance(outs, Mapping) else list(outs)
        if len(outs) != len(reqs):
            raise RuntimeError(f"SGLang returned {len(outs)} outputs for {len(reqs)} requests")
        wall = time.perf_counter() - t0
        if progress is not None:
            progress(len(reqs), len(reqs))
        return [self._row(r, o, wall) for r, o in zip(reqs, outs, strict=True)]

    def _row(self, req: TokenRequest, out: Mapping[str, Any], seconds: float) -> dict[str, Any]:
        meta = _meta(out, req.id)
        finish = meta.get("finish_reason")
        row = {"id": req.id, "output_token_ids": parse_generate_output(out),
               "finish_reason": finish.get("type") if isinstance(finish, Mapping) else finish, "seconds": seconds}
        if self.speculative:
            row.update(spec_counters(meta, self.steps))
        return row


def main(argv: list[str]) -> int:
    return driver_main(argv, Driver, "usage: python -m redraft.engines.sglang_driver  (settings and commands as JSON "
                       "lines on stdin; started by redraft.engines.sglang)")


if __name__ == "__main__":
    sys.exit(main(sys.argv))
