"""vLLM's chat-template options (add_generation_prompt, continue_final_message, chat_template_kwargs), against HF's
``apply_chat_template`` as the oracle, through ``render_conversation`` and ``LLM.chat``."""

from __future__ import annotations

import pytest

from coserve import LLM, SamplingParams
from coserve.model.chat_prompt import ChatPromptError, render_conversation
from coserve.model.tokenizer import load_tokenizer

# a template that reads a variable of its own, as Qwen3's reads enable_thinking
THINKING = ("{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
            "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
            "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\n\n</think>\n\n' }}{%- endif %}"
            "{%- endif %}")
PREFIXED = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "The colour is"}]
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(model_factory):
    return load_tokenizer(model_factory("llama"))


@pytest.fixture(scope="module")
def llm(model_factory):
    return LLM(model_factory("llama"), dtype="float32", device="cpu")


@pytest.mark.parametrize("options", [
    {}, {"add_generation_prompt": False}, {"add_generation_prompt": False, "continue_final_message": True}])
def test_the_options_render_as_hf_does(tokenizer, options):
    hf = {"add_generation_prompt": True, **options}
    assert render_conversation(tokenizer, PREFIXED, **options) == tokenizer.apply_chat_template(
        PREFIXED, tokenize=False, **hf)


def test_a_continued_message_ends_with_its_own_text(tokenizer):
    text = render_conversation(tokenizer, PREFIXED, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nThe colour is")
    closed = render_conversation(tokenizer, PREFIXED, add_generation_prompt=False)
    assert closed.endswith("The colour is<|im_end|>\n")


def test_template_kwargs_reach_the_template(tokenizer):
    tokenizer = load_tokenizer(tokenizer.name_or_path)
    tokenizer.chat_template = THINKING
    user = PREFIXED[:1]
    assert "<think>" not in render_conversation(tokenizer, user)
    assert render_conversation(tokenizer, user, chat_template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<think>" not in render_conversation(tokenizer, user, chat_template_kwargs={"enable_thinking": True})


def test_reasoning_effort_reaches_the_template_as_vllm_passes_it(tokenizer):
    """OpenAI's ``reasoning_effort`` (a chat request's, a Responses request's ``reasoning.effort``) is the template's
    ``reasoning_effort``, as gpt-oss's template reads it; ``chat_template_kwargs`` naming it wins; a value OpenAI does
    not have is refused naming the field."""
    from pydantic import ValidationError

    from coserve.server.protocol import ChatCompletionRequest
    tokenizer = load_tokenizer(tokenizer.name_or_path)
    tokenizer.chat_template = THINKING + "{{- 'effort: ' + reasoning_effort if reasoning_effort is defined }}"

    def rendered(**fields):
        body = ChatCompletionRequest.model_validate({"model": "m", "messages": PREFIXED[:1], **fields})
        return render_conversation(tokenizer, PREFIXED[:1], chat_template_kwargs=body.template_kwargs())

    assert rendered().endswith("assistant\n")
    assert rendered(reasoning_effort="low").endswith("assistant\neffort: low")
    assert rendered(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}).endswith("high")
    with pytest.raises(ValidationError, match="reasoning_effort"):
        ChatCompletionRequest.model_validate({"model": "m", "messages": PREFIXED[:1], "reasoning_effort": "lots"})


@pytest.mark.parametrize("kwargs, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt's default, true
    ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs.tokenize"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs.add_generation_prompt"),
    ({"chat_template_kwargs": {"not a name": 1}}, "chat_template_kwargs"),
])
def test_options_that_cannot_apply_name_their_field(tokenizer, kwargs, param):
    with pytest.raises(ChatPromptError) as e:
        render_conversation(tokenizer, PREFIXED, **kwargs)
    assert e.value.param == param and param.split(".")[0] in str(e.value)


def test_a_template_that_drops_the_final_message_cannot_continue_it(tokenizer):
    tokenizer = load_tokenizer(tokenizer.name_or_path)
    tokenizer.chat_template = "{%- for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{%- endfor %}"
    with pytest.raises(ChatPromptError) as e:
        render_conversation(tokenizer, PREFIXED, add_generation_prompt=False, continue_final_message=True)
    assert e.value.param == "continue_final_message"


def test_llm_chat_continues_the_final_message_as_vllm_does(llm):
    """The continued reply is the greedy continuation of exactly the rendered prefix: the same tokens as
    ``generate`` gives that prompt's ids."""
    out = llm.chat(PREFIXED, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    text = llm.tokenizer.apply_chat_template(PREFIXED, tokenize=False, continue_final_message=True)
    ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out.prompt_token_ids == ids
    assert out.token_ids == llm.generate([ids], GREEDY)[0].token_ids
    opened = llm.chat(PREFIXED[:1], GREEDY, add_generation_prompt=False)[0]
    assert opened.prompt_token_ids == llm.tokenizer(llm.tokenizer.apply_chat_template(
        PREFIXED[:1], tokenize=False), add_special_tokens=False)["input_ids"]
    with pytest.raises(ChatPromptError, match="continue_final_message"):
        llm.chat(PREFIXED, GREEDY, continue_final_message=True)
    assert llm.chat(PREFIXED[:1], GREEDY, chat_template_kwargs={"enable_thinking": True})[0].prompt_token_ids == \
        llm.chat(PREFIXED[:1], GREEDY)[0].prompt_token_ids  # a variable this template does not read changes nothing
