"""The regeneration server client's SGLang request, held against the real SGLang (run in the engine venv).

    PYTHONPATH=. $ENGINE_VENV/bin/python conformance/check_regen_api.py

``extract --regen-backend server`` sends SGLang ``/generate`` bodies built by
``redraft.engines.server.sglang_request``. SGLang's HTTP gate decodes them with its schema
(``sglang.api.v1.api_types.GenerateRequest``, unknown sampling keys refused), then builds its own
``SamplingParams`` and verifies them. Both are run here on greedy and sampled requests; the answer
shape ``parse_sglang`` reads is the one SGLang's tokenizer manager writes (checked in the unit tests).
Exit 0 when SGLang accepts every body, 1 with the refusal otherwise.
"""

from __future__ import annotations

import logging
import sys

from redraft.core import cli as ending
from redraft.engines.request import TokenRequest
from redraft.engines.server import sglang_request


def main() -> int:
    import sglang
    from sglang.api.v1.api_types import GenerateRequest
    from sglang.srt.sampling.sampling_params import SamplingParams

    cases = {
        "greedy": TokenRequest(id="0", prompt_token_ids=[1, 9690, 198], max_tokens=16, stop_token_ids=[2, 7]),
        "sampled": TokenRequest(id="1", prompt_token_ids=[1, 2, 3], max_tokens=8, temperature=0.7, top_p=0.9,
                                seed=1234, stop_token_ids=[2]),
        "no stop ids": TokenRequest(id="2", prompt_token_ids=[5], max_tokens=1),
    }
    failed = 0
    for name, req in cases.items():
        body = sglang_request(req)
        try:
            GenerateRequest.from_json_value(body)  # the HTTP gate (/generate's contract check)
            params = SamplingParams(**body["sampling_params"])
            params.verify(vocab_size=49152)
            if not params.no_stop_trim or set(params.stop_token_ids or ()) != set(req.stop_token_ids):
                raise ValueError(f"SGLang read no_stop_trim={params.no_stop_trim}, stop ids {params.stop_token_ids}")
        except Exception as e:  # noqa: BLE001 - report whatever SGLang refused with
            failed += 1
            print(f"check_regen_api: SGLang {sglang.__version__} refuses the {name} body {body}: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
            continue
        print(f"check_regen_api: SGLang {sglang.__version__} accepts the {name} /generate body")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(ending.run(main, logging.getLogger("conformance.check_regen_api")))
