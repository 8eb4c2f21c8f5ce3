"""``LoopClient``: generation through an engine running in its own thread, and ``abort()``, which ends the
generation in flight (its outputs come back, finish reason "abort", even when nothing else is running) and
refuses later ones."""

import threading
import time

import pytest

from coserve import LLM, SamplingParams
from coserve.engine.loop_client import LoopClient


def test_a_generation_in_flight_is_aborted_and_later_ones_refused(model_factory):
    llm = LLM(model_factory("llama"), dtype="float32", device="cpu")
    client = LoopClient(llm._background())
    prompt = [5, 17, 40, 9]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert client.generate([prompt], [greedy])[0].outputs[0].token_ids == \
        llm.generate([prompt], greedy)[0].outputs[0].token_ids
    result = {}

    def long_generation():
        result["out"] = client.generate([prompt], [SamplingParams(n=2, max_tokens=100_000, ignore_eos=True)])

    hold = threading.Event()
    client.loop.post(lambda: hold.wait(30))  # the engine thread waits here: the requests are enqueued after it
    thread = threading.Thread(target=long_generation)
    thread.start()
    while not client._lock.locked():  # the generation is handing its requests over (behind the held engine)
        time.sleep(0.001)
    threading.Timer(0.3, hold.set).start()
    client.abort()  # waits for the enqueue (the client's lock), then aborts the requests within an iteration or two
    thread.join(30)
    assert not thread.is_alive()  # the last requests' aborts were delivered though nothing else runs
    outs = result["out"][0].outputs
    assert [o.finish_reason for o in outs] == ["abort", "abort"]  # not "length": ended before the context's end
    with pytest.raises(RuntimeError, match="aborted"):
        client.generate([prompt], [greedy])
    assert llm.generate([prompt], greedy)[0].outputs[0].finish_reason == "length"  # the engine serves on
