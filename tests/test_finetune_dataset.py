"""Finetuning data sets: token ids and loss targets of text, Alpaca and chat records; file handling."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coserve.finetune.chat_format import encode_chat
from coserve.finetune.dataset import (DatasetError, DatasetReport, EmptyCompletionError, encode_record,
                                      load_dataset)
from coserve.finetune.sequence_state import IGNORE_INDEX
from coserve.model.tokenizer import load_tokenizer

BOS, EOS, IM_START, IM_END = 0, 1, 3, 4
WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further context. "
              "Write a response that appropriately completes the request.\n\n### Instruction:\n{}\n\n"
              "### Input:\n{}\n\n### Response:\n")
NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately completes the "
            "request.\n\n### Instruction:\n{}\n\n### Response:\n")


@pytest.fixture(scope="module")
def tok(model_factory):
    return load_tokenizer(model_factory("llama"))


def ids(tok, text, special=False):
    return tok(text, add_special_tokens=special)["input_ids"]


def expected_targets(token_ids, loss):
    """targets from a per-token loss mask, written out the slow way."""
    return [token_ids[t + 1] if t + 1 < len(token_ids) and loss[t + 1] else IGNORE_INDEX
            for t in range(len(token_ids))]


def write(tmp_path, name, lines):
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- record shapes ---------------------------------------------------------------------------

def test_text_record(tok):
    text = "The quick brown fox jumps over the lazy dog."
    ex, cut = encode_record({"text": text}, tok, 512)
    expect = tok(text)["input_ids"]
    assert expect[0] == BOS and ex.token_ids == expect and not cut
    assert ex.targets == expect[1:] + [IGNORE_INDEX]


@pytest.mark.parametrize("extra,template", [
    ({"input": "three apples"}, "with"), ({"input": ""}, "none"), ({}, "none"), ({"input": None}, "none"),
])
def test_alpaca_record(tok, extra, template):
    rec = {"instruction": "Count the fruit.", "output": "There are three.", **extra}
    prompt = (WITH_INPUT.format(rec["instruction"], rec["input"]) if template == "with"
              else NO_INPUT.format(rec["instruction"]))
    prompt_ids = tok(prompt)["input_ids"]
    completion = ids(tok, rec["output"]) + [EOS]
    ex, _ = encode_record(rec, tok, 512)
    assert prompt_ids[0] == BOS and prompt_ids.count(BOS) == 1
    assert ex.token_ids == prompt_ids + completion
    p = len(prompt_ids)
    assert ex.targets[:p - 1] == [IGNORE_INDEX] * (p - 1)  # no loss on the prompt
    assert ex.targets[p - 1:] == completion + [IGNORE_INDEX]  # the last prompt token predicts the output
    ex_all, _ = encode_record(rec, tok, 512, train_on_prompt=True)
    assert ex_all.token_ids == ex.token_ids
    assert ex_all.targets == ex.token_ids[1:] + [IGNORE_INDEX]


def chat_pieces(messages):
    """The ChatML rendering as (text, is_loss) pieces, written by hand."""
    pieces = []
    for m in messages:
        trained = m["role"] == "assistant" and m.get("weight", 1) == 1
        pieces.append((f"<|im_start|>{m['role']}\n", False))
        pieces.append((m["content"] + "<|im_end|>", trained))
        pieces.append(("\n", False))
    return pieces


def chat_expect(tok, messages, train_on_prompt=False):
    token_ids, loss = [], []
    for text, is_loss in chat_pieces(messages):
        piece = ids(tok, text)
        token_ids += piece
        loss += [is_loss] * len(piece)
    if train_on_prompt:
        weight0 = [False] * len(token_ids)
        at = 0
        for m in messages:
            n_head = len(ids(tok, f"<|im_start|>{m['role']}\n"))
            n_body = len(ids(tok, m["content"] + "<|im_end|>\n"))
            if m["role"] == "assistant" and m.get("weight", 1) == 0:
                weight0[at + n_head:at + n_head + n_body] = [True] * n_body
            at += n_head + n_body
        loss = [not w for w in weight0]
    return token_ids, expected_targets(token_ids, loss)


CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "Four.", "weight": 0},
    {"role": "user", "content": "And three plus three?"},
    {"role": "assistant", "content": "Six, of course."},
]


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_chat_record(tok, train_on_prompt):
    ex, cut = encode_record({"messages": CHAT}, tok, 512, train_on_prompt=train_on_prompt)
    whole = ids(tok, tok.apply_chat_template([{k: m[k] for k in ("role", "content")} for m in CHAT],
                                             tokenize=False))
    token_ids, targets = chat_expect(tok, CHAT, train_on_prompt)
    assert token_ids == whole and ex.token_ids == whole and not cut
    assert BOS not in ex.token_ids  # no bos added to the rendered template
    assert ex.targets == targets
    if not train_on_prompt:  # exactly the trained reply's content and its <|im_end|>
        assert [t for t in ex.targets if t != IGNORE_INDEX] == ids(tok, "Six, of course.") + [IM_END]


def test_chat_weights(tok):
    both = [dict(m, weight=1) if m["role"] == "assistant" else m for m in CHAT]
    ex, _ = encode_record({"messages": both}, tok, 512)
    assert ex.targets == chat_expect(tok, both)[1]
    loss = [t for t in ex.targets if t != IGNORE_INDEX]
    assert loss == ids(tok, "Four.") + [IM_END] + ids(tok, "Six, of course.") + [IM_END]
    assert ex.targets.count(IM_START) == 0  # headers carry no loss


@pytest.mark.parametrize("content", ["  leading spaces", "\n\nleading newlines", " x"])
def test_chat_content_merging_with_header(tok, content):
    """Whitespace at the start of a reply merges with the header's '\\n' in a whole-text tokenization;
    the reply is then tokenized apart from its prompt, as at inference."""
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content}]
    prompt = ids(tok, tok.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True))
    reply = ids(tok, content + "<|im_end|>")
    ex, _ = encode_record({"messages": msgs}, tok, 512)
    assert ex.token_ids == prompt + reply + ids(tok, "\n")
    assert tok.decode(ex.token_ids) == tok.apply_chat_template(msgs, tokenize=False)
    assert [t for t in ex.targets if t != IGNORE_INDEX] == reply


def test_chat_template_not_prefix_stable(model_factory):
    tok = load_tokenizer(model_factory("llama"))  # a private copy: the template is changed
    tok.chat_template = ("{{ messages|length }} turns\n{% for m in messages %}<|im_start|>{{ m.role }}\n"
                         "{{ m.content }}<|im_end|>\n{% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    with pytest.raises(ValueError, match="prefix-stable"):
        encode_chat(msgs, tok)


@pytest.mark.parametrize("messages,field", [
    ([], "messages"),
    ("hi", "messages"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}], r"messages\[1\]\.role"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}], r"messages\[1\]\.content"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 2}],
     r"messages\[1\]\.weight"),
    ([{"role": "user", "content": "a"}, "b"], r"messages\[1\]"),
    ([{"role": "user", "content": "a"}], "no assistant"),
    ([{"role": "assistant", "content": "a"}], r"messages\[0\]"),
])
def test_chat_bad_messages(tok, messages, field):
    with pytest.raises(ValueError, match=field) as info:
        encode_record({"messages": messages}, tok, 512)
    assert not isinstance(info.value, EmptyCompletionError)


@pytest.mark.parametrize("record", [
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "weight": 0}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "  "}]},
    {"instruction": "a", "input": "b", "output": " \n"},
    {"text": ""},
])
def test_empty_completion(tok, record):
    with pytest.raises(EmptyCompletionError):
        encode_record(record, tok, 512)


@pytest.mark.parametrize("record,field", [
    ({"instruction": "a", "output": 3}, "output"), ({"output": "a"}, "instruction"),
    ({"instruction": ["a"], "output": "b"}, "instruction"),
    ({"instruction": "a", "input": 1, "output": "b"}, "input"),
    ({"text": 5}, "text"), ({"prompt": "a", "completion": "b"}, "record"), ([1, 2], "record"),
])
def test_bad_record_names_field(tok, record, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        encode_record(record, tok, 512)


@pytest.mark.parametrize("record,field", [
    ({"instruction": "a\udc00", "output": "b"}, "instruction"), ({"instruction": "a", "output": "\ud800"}, "output"),
    ({"instruction": "a", "input": "\udfff", "output": "b"}, "input"), ({"text": "x\ud800y"}, "text"),
    ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "\udbff"}]},
     r"messages\[1\]\.content"),
])
def test_a_lone_surrogate_is_named_not_handed_to_the_tokenizer(tok, record, field):
    """JSON's ``"\\ud800"`` escape decodes to a str the tokenizer refuses with a TypeError naming nothing."""
    with pytest.raises(ValueError, match=rf"^{field}: holds an unpaired UTF-16 surrogate"):
        encode_record(record, tok, 512)


def test_a_lone_surrogate_line_is_skipped_and_reported(tok, tmp_path):
    path = write(tmp_path, "s.jsonl", [json.dumps(RECORDS[0]), '{"text": "a \\ud800 b"}', json.dumps(RECORDS[1])])
    examples, rep = load_dataset(path, tok, 256)
    assert [e.line for e in examples] == [1, 3] and [n for n, _ in rep.malformed] == [2]
    assert rep.malformed[0][1].startswith("text: holds an unpaired UTF-16 surrogate")


# ---- truncation --------------------------------------------------------------------------------

def test_truncation(tok):
    text = " ".join(["word"] * 100)
    full = tok(text)["input_ids"]
    ex, cut = encode_record({"text": text}, tok, 16)
    assert cut and ex.token_ids == full[:16] and ex.targets == full[1:16] + [IGNORE_INDEX]
    ex, cut = encode_record({"text": text}, tok, len(full))
    assert not cut and ex.token_ids == full
    rec = {"instruction": "Say it.", "output": text}  # cut inside the completion
    whole, _ = encode_record(rec, tok, 4096)
    ex, cut = encode_record(rec, tok, len(whole.token_ids) - 5)
    assert cut and ex.token_ids == whole.token_ids[:-5]
    assert ex.targets[:-1] == whole.targets[:len(ex.targets) - 1] and ex.targets[-1] == IGNORE_INDEX
    prompt_len = len(tok(NO_INPUT.format("Say it."))["input_ids"])
    with pytest.raises(EmptyCompletionError):  # the prompt fills the window: nothing to learn
        encode_record(rec, tok, prompt_len)
    ex, _ = encode_record(rec, tok, prompt_len + 1)  # one token of the output
    assert [t for t in ex.targets if t != IGNORE_INDEX] == [whole.token_ids[prompt_len]]


# ---- files ---------------------------------------------------------------------------------------

RECORDS = [{"text": "plain text"}, {"instruction": "Do it.", "output": "Done."},
           {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]


def test_json_and_jsonl_detected_by_content(tok, tmp_path):
    as_array = tmp_path / "records.jsonl"  # misleading extensions on purpose
    as_array.write_text("  \n" + json.dumps(RECORDS, indent=2), encoding="utf-8")
    as_lines = write(tmp_path, "records.json", [json.dumps(RECORDS[0]), "", "   ",
                                                json.dumps(RECORDS[1]), json.dumps(RECORDS[2])])
    a, rep_a = load_dataset(as_array, tok, 256)
    b, rep_b = load_dataset(as_lines, tok, 256)
    assert [e.line for e in a] == [1, 2, 3] and rep_a.json_array
    assert [e.line for e in b] == [1, 4, 5] and not rep_b.json_array  # blank lines count as lines
    assert [e.token_ids for e in a] == [e.token_ids for e in b]
    assert [e.targets for e in a] == [e.targets for e in b]
    assert rep_a.num_records == rep_b.num_records == 3 and rep_a.num_examples == 3
    expect = [encode_record(r, tok, 256)[0] for r in RECORDS]
    assert [e.token_ids for e in a] == [e.token_ids for e in expect]


def test_malformed_lines_reported(tok, tmp_path):
    path = write(tmp_path, "mixed.jsonl", [
        json.dumps(RECORDS[0]),                                       # 1 good
        "",                                                           # 2 blank
        '{"text": "unterminated',                                     # 3 bad JSON
        '"just a string"',                                            # 4 not an object
        json.dumps({"prompt": "p", "completion": "c"}),               # 5 no shape
        json.dumps({"instruction": "x", "output": 3}),                # 6 wrong type
        json.dumps({"messages": [{"role": "tool", "content": "x"}]}), # 7 bad role
        json.dumps(RECORDS[1]),                                       # 8 good
        json.dumps({"instruction": "x", "output": ""}),               # 9 empty completion
        json.dumps(RECORDS[2]),                                       # 10 good
    ])
    examples, rep = load_dataset(path, tok, 256)
    assert [e.line for e in examples] == [1, 8, 10]
    assert [n for n, _ in rep.malformed] == [3, 4, 5, 6, 7]
    reasons = dict(rep.malformed)
    assert "invalid JSON" in reasons[3] and "string" in reasons[4] and "'prompt'" in reasons[5]
    assert reasons[6].startswith("output") and reasons[7].startswith("messages[0].role")
    assert rep.empty_completion == [9] and rep.num_records == 9 and rep.num_examples == 3
    assert rep.summary() == ("3 examples from mixed.jsonl; 5 malformed (lines 3, 4, 5, 6, 7); "
                             "1 with an empty completion (line 9)")


def test_report_counts_truncated(tok, tmp_path):
    long = {"text": " ".join(["word"] * 50)}
    path = write(tmp_path, "long.jsonl", [json.dumps(long), json.dumps(RECORDS[0]), json.dumps(long)])
    examples, rep = load_dataset(path, tok, 10)
    assert rep.truncated == 2 and all(len(e.token_ids) <= 10 for e in examples)
    assert examples[0].targets[-1] == IGNORE_INDEX
    assert rep.summary() == "3 examples from long.jsonl; 2 truncated to 10 tokens"


def test_no_valid_example(tok, tmp_path):
    path = write(tmp_path, "bad.jsonl", ['{"nope": 1}', "not json", json.dumps({"text": ""})])
    with pytest.raises(DatasetError) as info:
        load_dataset(path, tok, 64)
    msg = str(info.value)
    assert str(path) in msg and "line 1: record" in msg and "line 2: invalid JSON" in msg
    assert "line 3" in msg
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(DatasetError, match="missing.jsonl"):
        load_dataset(missing, tok, 64)
    empty = tmp_path / "empty.json"
    empty.write_text("\n\n")
    with pytest.raises(DatasetError, match="empty.json"):
        load_dataset(empty, tok, 64)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"text": "a"},\n {"text": ')
    with pytest.raises(DatasetError, match="broken.json.*line 2"):
        load_dataset(broken, tok, 64)
    with pytest.raises(DatasetError, match=str(tmp_path.name)):
        load_dataset(tmp_path, tok, 64)  # a directory
    assert issubclass(DatasetError, ValueError)


def test_summary_of_json_array_names_records():
    rep = DatasetReport(path="/x/data.json", num_records=12, num_examples=1,
                        malformed=[(n, "r") for n in range(2, 9)], empty_completion=[10], json_array=True)
    assert rep.summary() == ("1 example from data.json; 7 malformed (records 2, 3, 4, 5, 6, ... (2 more)); "
                             "1 with an empty completion (record 10)")


def test_alpaca_demo(tok, shared_data):
    examples, rep = load_dataset(shared_data / "alpaca_en_demo.json", tok, 1024)
    assert len(examples) == rep.num_examples == rep.num_records == 1000
    assert not rep.malformed and not rep.empty_completion and rep.json_array
    assert all(len(e.token_ids) <= 1024 for e in examples)
    assert all(e.token_ids[-1] == EOS for e in examples if len(e.token_ids) < 1024)  # whole completions
    assert all(e.token_ids[0] == BOS and e.token_ids.count(BOS) == 1 for e in examples)
    assert rep.summary().startswith("1000 examples from alpaca_en_demo.json")


# ---- property ----------------------------------------------------------------------------------

_piece = st.sampled_from(["hello", " world", "\n", "  ", "\t", "é", "日本語", "<|im_end|>", "<|im_start|>",
                          "<|end_of_text|>", "### Response:\n", "x", "123", "!"])
_text = st.lists(_piece | st.text(max_size=4), max_size=8).map("".join)


@st.composite
def _chat(draw):
    msgs = [{"role": "system", "content": draw(_text)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        msgs.append({"role": "user", "content": draw(_text)})
        reply = {"role": "assistant", "content": draw(_text)}
        if draw(st.booleans()):
            reply["weight"] = draw(st.sampled_from([0, 1]))
        msgs.append(reply)
    return {"messages": msgs}


_record = st.one_of(
    st.builds(lambda t: {"text": t}, _text),
    st.builds(lambda i, x, o: {"instruction": i, "input": x, "output": o}, _text, _text, _text),
    _chat(),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(record=_record, max_seq_len=st.integers(2, 80), train_on_prompt=st.booleans())
def test_property_targets_are_next_tokens(tok, record, max_seq_len, train_on_prompt):
    try:
        ex, cut = encode_record(record, tok, max_seq_len, train_on_prompt)
    except EmptyCompletionError:
        return
    assert len(ex.targets) == len(ex.token_ids) <= max_seq_len
    assert ex.targets[-1] == IGNORE_INDEX
    assert any(t != IGNORE_INDEX for t in ex.targets)
    for t, target in enumerate(ex.targets):
        assert target == IGNORE_INDEX or target == ex.token_ids[t + 1]
    whole, whole_cut = encode_record(record, tok, 100_000, train_on_prompt)
    assert not whole_cut and cut == (len(whole.token_ids) > max_seq_len)
    n = len(ex.token_ids)
    assert ex.token_ids == whole.token_ids[:n] and ex.targets[:-1] == whole.targets[:n - 1]
