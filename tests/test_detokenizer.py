"""Output text kept up to date token by token (coserve/engine/detokenizer.py) against the full decode."""

from __future__ import annotations

import random

import pytest

from coserve.engine.detokenizer import IncrementalText
from coserve.engine.output_processor import OutputProcessor
from coserve.model.tokenizer import load_tokenizer
from coserve.scheduler import Request, SamplingParams
from coserve.scheduler.scheduler import TokenEvent

TEXTS = ["héllo wörld 你好 🎉🎉 test", "a .b , c", "  spaces   ", "ünïcödé 🙂 ok", "\n\n\tx", "日本語のテキスト"]


def _sequences(tokenizer, seed: int) -> list[list[int]]:
    """Random token ids (byte tokens split characters everywhere), and real multilingual text with special
    tokens inside."""
    rng = random.Random(seed)
    special = tokenizer.all_special_ids
    out = [[rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 60))] for _ in range(60)]
    for i in range(40):
        ids = tokenizer.encode("".join(rng.choice(TEXTS) for _ in range(3)), add_special_tokens=False)
        out.append(ids + [rng.choice(special)] + ids if i % 2 else ids)
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("skip", [True, False])  # vLLM's skip_special_tokens
def test_the_text_at_every_token_is_the_full_decode_or_a_prefix_short_of_an_unfinished_character(
        model_factory, arch, skip):
    tokenizer = load_tokenizer(model_factory(arch))
    pending_seen = 0
    for ids in _sequences(tokenizer, seed=3):
        inc = IncrementalText(tokenizer, skip_special_tokens=skip)
        for n in range(1, len(ids) + 1):
            full = tokenizer.decode(ids[:n], skip_special_tokens=skip)
            text = inc.text(ids[:n])
            assert full.startswith(text)
            if text != full:
                assert "\ufffd" in full[len(text):]  # only bytes of an unfinished character are held back
                pending_seen += 1
            assert inc.text(ids[:n], exact=True) == full
    assert pending_seen > 0  # the sequences did split characters


def test_a_tokenizer_whose_decode_cleans_up_across_tokens_is_decoded_whole(model_factory):
    tokenizer = load_tokenizer(model_factory("llama"))
    tokenizer.clean_up_tokenization_spaces = True  # " ." -> "." reads across token boundaries
    ids = tokenizer.encode("a . b , c ! d", add_special_tokens=False)
    inc = IncrementalText(tokenizer)
    for n in range(1, len(ids) + 1):  # (transformers 5 declines the clean-up for BPE; 4.x applies it)
        assert inc.text(ids[:n]) == tokenizer.decode(ids[:n], skip_special_tokens=True)


def test_a_stop_string_just_before_an_unfinished_character_stops_the_request_at_that_token(model_factory):
    """A token holding "x" and the first byte of a character: the held-back text lacks the "x", so the stop check
    must see the full decode, as it did before text was kept incrementally."""
    tokenizer = load_tokenizer(model_factory("llama"))
    token = next(t for t in range(len(tokenizer))
                 if (s := tokenizer.decode([t])).endswith("\ufffd") and len(s) >= 2 and s[-2].isascii()
                 and s[-2].isalnum())
    stop = tokenizer.decode([token])[-2]
    prefix = tokenizer.encode(" ok", add_special_tokens=False)
    request = Request("r", [5, 6], SamplingParams(max_tokens=20, temperature=0, stop=[stop]), None,
                      frozenset(), 0.0)
    outputs = OutputProcessor(tokenizer)
    outputs.add(request, None)
    ids = prefix + [token]
    for i, t in enumerate(ids):
        request.output_token_ids.append(t)
        stopped = outputs.process(request, TokenEvent("r", t, None, False, None))
        assert stopped == (i == len(ids) - 1)
    final = outputs.output(request, True)
    assert final.outputs[0].text == tokenizer.decode(ids, skip_special_tokens=True).split(stop)[0]
    assert final.outputs[0].stop_reason == stop
