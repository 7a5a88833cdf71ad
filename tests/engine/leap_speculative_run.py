"""One LEAP engine under ngram speculative decoding, in its own process.

Run by ``test_a_loop_is_caught_when_speculative_steps_jump_over_the_check_multiples``
(``python -m tests.engine.leap_speculative_run``): vLLM 0.32 cannot start another
engine in a process where the ngram proposer has imported numba. Steps tiny-llama's
repeating answer until LEAP calls it a loop and prints, as the last line of JSON,
the output counts after each step, the prediction then, and whether the request's
loop-check entry outlived it.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.engine.leap_helpers import (
    leap_connector_of,
    leap_engine_kwargs,
    run_to_completion,
    scheduler_of,
    write_weights,
)
from tests.helpers import engine

PROMPT = list(range(114, 204))  # tiny-llama answers it with one token repeated


def main() -> None:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4}
    with tempfile.TemporaryDirectory() as folder:
        weights = write_weights(Path(folder) / "w.npz", 128)
        kwargs = leap_engine_kwargs({"weights_path": str(weights)}, speculative_config=spec)
        with engine("tiny-llama", **kwargs) as llm:
            engine_ = llm.llm_engine
            engine_.add_request("long", {"prompt_token_ids": PROMPT}, params)
            engine_.step()
            scheduler = scheduler_of(llm)
            (runner,) = scheduler.running
            runtime = leap_connector_of(llm).runtime
            counts = [runner.num_output_tokens]
            while not runtime.is_exact(runner.request_id) and runner.num_output_tokens < 300:
                engine_.step()
                counts.append(runner.num_output_tokens)
            predicted = runtime.prediction(runner.request_id).total_tokens
            run_to_completion(llm)
            # entries are dropped at the next schedule: one more request steps it
            short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            engine_.add_request("next", {"prompt_token_ids": PROMPT[:13]}, short)
            run_to_completion(llm)
            still_due = runner.request_id in scheduler._leap_loop_due
    result = {"counts": counts, "predicted": predicted, "still_due": still_due}
    sys.stdout.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
