"""OpenAI's graders: the text-similarity metrics against their reference implementations (rapidfuzz, NLTK, Google's
rouge_score), string checks, templates, multi graders' formulas, python graders in their own process, and the errors
that name the field."""

import random
import sys

import pytest
from nltk.translate.bleu_score import SmoothingFunction
from nltk.translate.bleu_score import sentence_bleu as nltk_bleu
from nltk.translate.gleu_score import sentence_gleu as nltk_gleu
from rapidfuzz import fuzz
from rouge_score import rouge_scorer

from coserve.finetune import text_similarity as ts
from coserve.finetune.grader_formula import Formula
from coserve.finetune.graders import grader_reward, make_sample, parse_grader
from coserve.finetune.model_graders import ModelReply

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "Paris", "Pâris", ".", ",", "is", "IS", "42", "x-y", "日本"]


def texts(rng, n):
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(0, 14))) for _ in range(n)]


def test_the_metrics_equal_their_reference_implementations():
    rng = random.Random(0)
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rouge3", "rouge4", "rouge5", "rougeL"])
    smooth = SmoothingFunction().method1
    pairs = list(zip(texts(rng, 400), texts(rng, 400))) + [("", ""), ("Paris", "Paris"), ("a b c d e", "a b c d e")]
    for a, b in pairs:
        assert ts.similarity("fuzzy_match", a, b) == pytest.approx(fuzz.ratio(a, b) / 100, abs=1e-12)
        wa, wb = ts.words(a), ts.words(b)
        if wa and wb:  # NLTK divides by the hypothesis' length
            assert ts.similarity("bleu", a, b) == pytest.approx(nltk_bleu([wb], wa, smoothing_function=smooth),
                                                                abs=1e-12), (a, b)
        assert ts.similarity("gleu", a, b) == pytest.approx(nltk_gleu([wb], wa), abs=1e-12), (a, b)
        scores = scorer.score(b, a)
        for n in range(1, 6):
            assert ts.similarity(f"rouge_{n}", a, b) == pytest.approx(scores[f"rouge{n}"].fmeasure, abs=1e-12)
        assert ts.similarity("rouge_l", a, b) == pytest.approx(scores["rougeL"].fmeasure, abs=1e-12)


def test_fuzzy_match_of_long_texts_and_the_bit_parallel_lcs():
    rng = random.Random(1)
    a = "".join(rng.choice("abcdé ") for _ in range(3000))
    b = "".join(rng.choice("abcdé ") for _ in range(2500))
    assert ts.similarity("fuzzy_match", a, b) == pytest.approx(fuzz.ratio(a, b) / 100, abs=1e-12)
    for _ in range(200):  # against the textbook table
        x = [rng.randrange(4) for _ in range(rng.randint(0, 20))]
        y = [rng.randrange(4) for _ in range(rng.randint(0, 20))]
        table = [[0] * (len(y) + 1) for _ in range(len(x) + 1)]
        for i in range(len(x)):
            for j in range(len(y)):
                table[i + 1][j + 1] = table[i][j] + 1 if x[i] == y[j] else max(table[i][j + 1], table[i + 1][j])
        assert ts.lcs_length(x, y) == table[-1][-1]


def string_check(operation, reference="{{ item.answer }}"):
    return parse_grader({"type": "string_check", "name": "check", "input": "{{ sample.output_text }}",
                         "reference": reference, "operation": operation})


@pytest.mark.parametrize("operation,expected", [("eq", [1, 0, 0, 0]), ("ne", [0, 1, 1, 1]),
                                                ("like", [1, 1, 0, 0]), ("ilike", [1, 1, 1, 0])])
def test_string_checks(operation, expected):
    outputs = ["Paris", "It is Paris.", "PARIS!", "Lyon"]
    scores, subs = string_check(operation).grade([make_sample(o) for o in outputs], [{"answer": "Paris"}] * 4)
    assert scores == expected and subs == {}


def test_templates_reach_into_items_and_json_outputs():
    g = string_check("eq", reference="{{item.meta.cities.1}}|{{ item.n }}|{{ sample.output_json.city }}")
    item = {"meta": {"cities": ["Lyon", "Paris"]}, "n": 3}
    assert g.reference.render(item, make_sample('{"city": "Nice"}')) == "Paris|3|Nice"
    assert g.grade([make_sample('{"city": "Nice"}')], [item])[0] == [0.0]
    with pytest.raises(ValueError, match=r"sample 0: .*\{\{ sample.output_json.city \}\}: the sample has no "
                                         r"sample.output_json.city"):
        g.grade([make_sample("not json")], [item])
    with pytest.raises(ValueError, match=r"the item has no item.answer"):
        string_check("eq").grade([make_sample("x")], [{"question": "?"}])


def test_a_multi_grader_combines_named_graders_by_its_formula():
    g = parse_grader({"type": "multi", "name": "total", "calculate_output": "0.25 * exact + 0.75 * max(sim, 0.5)^2",
                      "graders": {"exact": {"type": "string_check", "name": "exact", "operation": "eq",
                                            "input": "{{sample.output_text}}", "reference": "{{item.answer}}"},
                                  "sim": {"type": "text_similarity", "name": "sim", "evaluation_metric": "rouge_1",
                                          "input": "{{sample.output_text}}", "reference": "{{item.answer}}"}}})
    scores, subs = g.grade([make_sample("the cat sat"), make_sample("a dog")], [{"answer": "the cat sat"}] * 2)
    assert subs == {"exact": [1.0, 0.0], "sim": [1.0, 0.0]}
    assert scores == [pytest.approx(1.0), pytest.approx(0.75 * 0.25)]


@pytest.mark.parametrize("text,message", [
    ("a + b", r"'b' is not one of the graders \(a\)"),
    ("a.__class__", r"'a.__class__' is not allowed in a formula"),
    ("open(a)", r"open\(\) is not one of min"),
    ("a +", r"not a formula"),
    ("[a]", r"'\[a\]' is not allowed"),
    ("a ^ 2 ^ -1 + 1", None),
    ("", r"expected a formula"),
])
def test_formulas_outside_the_language_are_refused(text, message):
    if message is None:  # ^ is a power, right-associative and binding tighter than +
        assert Formula(text, {"a"}).value({"a": 4.0}) == pytest.approx(4.0 ** 0.5 + 1)
        return
    with pytest.raises(ValueError, match=r"^calculate_output: " + message):
        Formula(text, {"a"})


def test_a_formula_undefined_for_the_scores_is_an_error():
    f = Formula("a / b + 2 ** 3 - sqrt(b)", {"a", "b"})
    assert f.value({"a": 1.0, "b": 4.0}) == pytest.approx(0.25 + 8 - 2)
    with pytest.raises(ValueError, match="undefined"):
        f.value({"a": 1.0, "b": 0.0})
    with pytest.raises(ValueError, match="undefined"):
        Formula("10 ^ 400", set()).value({})  # floats overflow rather than grow


PYTHON = ("import math\n\ndef grade(sample, item):\n    print('graded', item)\n"
          "    if item.get('boom'):\n        raise KeyError('boom')\n"
          "    return 1.0 if sample['output_text'].strip() == str(item['answer']) else 0.0\n")


def test_a_python_grader_runs_in_its_own_process():
    g = parse_grader({"type": "python", "name": "py", "source": PYTHON})
    scores, _ = g.grade([make_sample(" 4 "), make_sample("5")], [{"answer": 4}, {"answer": 4}])
    assert scores == [1.0, 0.0]
    with pytest.raises(ValueError, match=r"grader 'py': sample 1: KeyError: 'boom'"):
        g.grade([make_sample("4"), make_sample("4")], [{"answer": 4}, {"answer": 4, "boom": True}])
    bad = parse_grader({"type": "python", "name": "py", "source": "def grade(s, i):\n    return 'high'\n"})
    with pytest.raises(ValueError, match=r"sample 0: TypeError: grade\(\) returned 'high', not a finite number"):
        bad.grade([make_sample("x")], [{}])
    broken = parse_grader({"type": "python", "name": "py", "source": "import no_such_module\ndef grade(s, i): pass"})
    with pytest.raises(ValueError, match="the python grader failed: ModuleNotFoundError"):
        broken.grade([make_sample("x")], [{}])


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX resource limits")
def test_a_python_grader_cannot_take_more_than_its_memory_or_write_large_files():
    big = parse_grader({"type": "python", "name": "big",
                        "source": "def grade(s, i):\n    if i['what'] == 'memory':\n"
                                  "        b = bytearray(3 * 2**30)\n"
                                  "    else:\n        open(i['path'], 'wb').write(bytes(65 * 2**20))\n"
                                  "    return 1.0\n"})
    out = big.outcomes([make_sample("x")] * 2, [{"what": "memory"}, {"what": "file", "path": "f"}])[0]  # (its own
    #   working directory)
    assert out[0].kind == "python_grader_runtime_error" and "MemoryError" in str(out[0])
    assert out[1].kind == "python_grader_runtime_error" and "File too large" in str(out[1])


def test_a_python_grader_has_no_network_where_the_kernel_gives_it_a_namespace():
    """A grader that connects to a socket listening on this machine's loopback fails: its process runs in a network
    namespace of its own (no interface up), and Landlock (ABI 4 on) refuses it TCP. Skipped where the kernel allows
    neither (the grader then runs with the network, and the server logs it)."""
    import socket

    from coserve.finetune import python_grader
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen(1)
        port = listening.getsockname()[1]
        g = parse_grader({"type": "python", "name": "net", "source": (
            "import socket\ndef grade(s, i):\n"
            f"    socket.create_connection(('127.0.0.1', {port}), timeout=5).close()\n    return 1.0\n")})
        out = g.outcomes([make_sample("x")], [{}])[0]
    if not python_grader.network_isolated:
        pytest.skip("this kernel gives a process no network namespace of its own, nor Landlock's TCP rules")
    assert out[0].kind == "python_grader_runtime_error"  # unreachable, or refused by Landlock
    assert "OSError: [Errno 101]" in str(out[0]) or "PermissionError" in str(out[0]), str(out[0])


def test_a_python_grader_can_make_no_internet_socket_udp_included():
    """A seccomp filter refuses the grader sockets of IPv4, IPv6 and raw packets, UDP included (which neither
    Landlock nor a missing namespace would stop); Unix sockets are allowed. Skipped where the filter cannot be set
    (another architecture, or a kernel without seccomp filters)."""
    from coserve.finetune import python_grader
    g = parse_grader({"type": "python", "name": "udp", "source": (
        "import socket\ndef grade(s, i):\n"
        "    if i['do'] == 'udp':\n"
        "        socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', 9))\n"
        "    if i['do'] == 'ipv6':\n        socket.socket(socket.AF_INET6, socket.SOCK_STREAM)\n"
        "    socket.socketpair()[0].close()\n    return 1.0\n")})
    out = g.outcomes([make_sample("x")] * 3, [{"do": "udp"}, {"do": "ipv6"}, {"do": "unix"}])[0]
    if not python_grader.sockets_refused:
        pytest.skip("no seccomp filter on this machine")
    for o in out[:2]:
        assert o.kind == "python_grader_runtime_error" and "PermissionError" in str(o), str(o)
    assert out[2] == 1.0 and python_grader.network_isolated  # a Unix socket pair works


def test_a_python_grader_reads_only_pythons_libraries_and_writes_only_its_own_directory(tmp_path):
    """Where the kernel has Landlock, a grader cannot open the server's files (a state directory's, or any outside
    Python's and the system's libraries) for reading or writing; it imports the standard library and installed
    packages (numpy), and writes and reads files in its own working directory, which is gone after it. Skipped
    without Landlock (the grader then reads what the server's user can, and the server logs it)."""
    from coserve.finetune import python_grader
    secret = tmp_path / "state" / "store.sqlite3"
    secret.parent.mkdir()
    secret.write_text("another tenant's data")
    g = parse_grader({"type": "python", "name": "fs", "source": (
        "import os\ndef grade(s, i):\n"
        "    if i['do'] == 'read':\n        return len(open(i['path']).read())\n"
        "    if i['do'] == 'list':\n        return len(os.listdir(i['path']))\n"
        "    if i['do'] == 'write':\n        open(i['path'], 'w').write('x')\n        return 1.0\n"
        "    import decimal, numpy, statistics, tempfile\n"
        "    with open('own.txt', 'w') as f:\n        f.write('kept')\n"
        "    with tempfile.NamedTemporaryFile('w') as t:\n        t.write('x')\n"
        "    return float(numpy.float64(len(open('own.txt').read())) + statistics.mean([0, 0]))\n")})
    items = [{"do": "read", "path": str(secret)}, {"do": "list", "path": str(secret.parent)},
             {"do": "write", "path": str(tmp_path / "new")}, {"do": "read", "path": "/etc/hostname"},
             {"do": "own"}]
    out = g.outcomes([make_sample("x")] * len(items), items)[0]
    if not python_grader.filesystem_isolated:
        pytest.skip("this kernel has no Landlock")
    assert out[-1] == 4.0  # its own file, the standard library and numpy
    for o in out[:-1]:
        assert o.kind == "python_grader_runtime_error" and "PermissionError" in str(o), str(o)
    assert not (tmp_path / "new").exists()


def test_a_python_grader_over_its_time_limit_fails(monkeypatch):
    from coserve.finetune import python_grader
    slow = parse_grader({"type": "python", "name": "slow",
                         "source": "import time\ndef grade(s, i):\n    time.sleep(30)\n    return 1.0\n"})
    real = python_grader.run_python_grader
    monkeypatch.setattr("coserve.finetune.graders.run_python_grader",
                        lambda source, pairs: real(source, pairs, timeout_s=1.0))
    with pytest.raises(ValueError, match=r"took more than 1 s for 1 sample"):
        slow.grade([make_sample("x")], [{}])


@pytest.mark.parametrize("spec,message", [
    ([], r"grader: expected a grader object"),
    ({"type": "score_model", "name": "s"}, r"grader.model: expected the name of a model"),
    ({"type": "score_model", "name": "s", "model": "m", "input": "hi"}, r"grader.input: expected an array"),
    ({"type": "score_model", "name": "s", "model": "m", "input": [{"role": "robot", "content": "x"}]},
     r"grader.input.0.role: expected one of system, developer, user, assistant"),
    ({"type": "score_model", "name": "s", "model": "m",
      "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     r"grader.input.0.content.0: expected text or an input_text/output_text part, got 'input_image'"),
    ({"type": "score_model", "name": "s", "model": "m", "input": [{"role": "user", "content": "{{ x }}"}]},
     r"grader.input.0.content: \{\{ x \}\} is not item"),
    ({"type": "score_model", "name": "s", "model": "m", "input": [{"role": "user", "content": "x"}],
      "range": [1, 1]}, r"grader.range: expected \[low, high\]"),
    ({"type": "score_model", "name": "s", "model": "m", "input": [{"role": "user", "content": "x"}],
      "sampling_params": {"temperature": 3}}, r"grader.sampling_params.temperature: expected a number from 0 to 2"),
    ({"type": "score_model", "name": "s", "model": "m", "input": [{"role": "user", "content": "x"}],
      "sampling_params": {"max_tokens": 3}}, r"grader.sampling_params.max_tokens: not a sampling parameter"),
    ({"type": "label_model", "name": "s", "model": "m", "input": [{"role": "user", "content": "x"}],
      "labels": ["a", "a"], "passing_labels": ["a"]}, r"grader.labels: expected 1 to 256 distinct"),
    ({"type": "label_model", "name": "s", "model": "m", "input": [{"role": "user", "content": "x"}],
      "labels": ["a", "b"], "passing_labels": ["c"]}, r"grader.passing_labels: 'c' is not one of the labels"),
    ({"type": "regex", "name": "s"}, r"grader.type: expected one of string_check, text_similarity"),
    ({"type": "string_check", "input": "", "reference": "", "operation": "eq"}, r"grader.name: expected"),
    ({"type": "string_check", "name": "s", "input": "{{ answer }}", "reference": "", "operation": "eq"},
     r"grader.input: \{\{ answer \}\} is not item.<field> or sample.<field>"),
    ({"type": "string_check", "name": "s", "input": "{{ sample.text }}", "reference": "", "operation": "eq"},
     r"grader.input: \{\{ sample.text \}\}: the sample has output_text"),
    ({"type": "string_check", "name": "s", "input": "", "reference": 3, "operation": "eq"},
     r"grader.reference: expected text"),
    ({"type": "string_check", "name": "s", "input": "", "reference": "", "operation": "regex"},
     r"grader.operation: expected one of eq, ne, like, ilike"),
    ({"type": "text_similarity", "name": "s", "input": "", "reference": "", "evaluation_metric": "cosine"},
     r"grader.evaluation_metric: 'cosine' is not supported \(it needs an embedding model\)"),
    ({"type": "python", "name": "p", "source": "def grade(s, i):\n  return (\n"}, r"grader.source: line 2"),
    ({"type": "python", "name": "p", "source": "def score(s, i): return 1"}, r"grader.source: defines no"),
    ({"type": "multi", "name": "m", "graders": {}, "calculate_output": "1"}, r"grader.graders: expected an object"),
    ({"type": "multi", "name": "m", "calculate_output": "x",
      "graders": {"x": {"type": "multi", "name": "x"}}}, r"grader.graders.x.type: a multi grader's graders cannot"),
    ({"type": "multi", "name": "m", "calculate_output": "x",
      "graders": {"x": {"type": "string_check", "name": "x", "input": "", "reference": "", "operation": "is"}}},
     r"grader.graders.x.operation: expected one of"),
])
def test_bad_graders_are_refused_naming_the_field(spec, message):
    with pytest.raises(ValueError, match="^" + message):
        parse_grader(spec)


def test_python_graders_can_be_switched_off():
    with pytest.raises(ValueError, match=r"grader.graders.p.type: python graders are off on this server"):
        parse_grader({"type": "multi", "name": "m", "calculate_output": "p",
                      "graders": {"p": {"type": "python", "name": "p", "source": PYTHON}}}, allow_python=False)


SCORE = {"type": "score_model", "name": "judge", "model": "base", "range": [1, 7.5],
         "sampling_params": {"temperature": 0.5, "seed": 3, "max_completions_tokens": 9},
         "input": [{"role": "developer", "content": "Score from 1 to 7.5."},
                   {"type": "message", "role": "user",
                    "content": [{"type": "input_text", "text": "Q: {{ item.q }} "},
                                {"type": "output_text", "text": "A: {{ sample.output_text }}"}]}]}


class RecordingJudge:
    """Stands in for the engine: records the calls and answers each with the next canned reply."""

    def __init__(self, *texts: str, finish: str = "stop") -> None:
        self.texts, self.finish, self.calls = list(texts), finish, []

    def __call__(self, calls):
        self.calls += calls
        return [ModelReply(self.texts.pop(0), self.finish, 10, 3) for _ in calls]


def test_a_score_model_grader_asks_the_judge_and_reads_a_result_within_its_range():
    grader = parse_grader(SCORE)
    judge = RecordingJudge('{"result":6.5}', '{"result":7.6}', "not json", '{"score":2}')
    samples = [make_sample(t) for t in ("yes", "no", "maybe", "x")]
    items = [{"q": "a"}, {"q": "b"}, {"q": "c"}, {"q": "d"}]
    scores, _ = grader.outcomes(samples, items, judge)
    assert scores[0] == 6.5
    assert [e.kind for e in scores[1:]] == ["model_grader_parse_error"] * 3
    assert "outside the range [1, 7.5]" in str(scores[1]) and "is not {\"result\": number}" in str(scores[2])
    first = judge.calls[0]
    assert first.model == "base" and first.messages == [{"role": "system", "content": "Score from 1 to 7.5."},
                                                          {"role": "user", "content": "Q: a A: yes"}]
    p = first.params
    assert (p.temperature, p.seed, p.max_tokens) == (0.5, 3, 9)
    assert p.guided_json["properties"]["result"] == {"type": "number", "minimum": 1, "maximum": 8}
    cut = parse_grader(SCORE).outcomes([samples[0]], [items[0]], RecordingJudge('{"result":', finish="length"))[0]
    assert cut[0].kind == "model_grader_parse_error" and "cut at 9 tokens" in str(cut[0])
    missing = grader.outcomes([samples[0]], [{}], RecordingJudge())[0]
    assert missing[0].kind == "invalid_variable_error"

    def unknown(calls):
        raise LookupError("model 'base': no such model")
    assert grader.outcomes([samples[0]], [items[0]], unknown)[0][0].kind == "model_grader_server_error"
    assert grader.outcomes([samples[0]], [items[0]], None)[0][0].kind == "model_grader_server_error"


def test_a_label_model_grader_passes_the_passing_labels_and_a_multi_grader_uses_it():
    label = {"type": "label_model", "name": "tone", "model": "base", "labels": ["kind", "rude", "flat"],
             "passing_labels": ["kind", "flat"], "input": [{"role": "user", "content": "{{ sample.output_text }}"}]}
    judge = RecordingJudge("kind", "rude", "flat")
    scores, _ = parse_grader(label).outcomes([make_sample(t) for t in "abc"], [{}] * 3, judge)
    assert scores == [1.0, 0.0, 1.0]
    assert judge.calls[0].params.guided_choice == ["kind", "rude", "flat"] and judge.calls[0].params.temperature == 0
    multi = parse_grader({"type": "multi", "name": "m", "calculate_output": "0.5 * tone + 0.5 * same",
                          "graders": {"tone": label, "same": {"type": "string_check", "name": "same",
                                                             "input": "{{ sample.output_text }}", "reference": "a",
                                                             "operation": "eq"}}})
    scores, subs = multi.outcomes([make_sample(t) for t in "ab"], [{}] * 2, RecordingJudge("rude", "kind"))
    assert scores == [0.5, 0.5] and subs == {"tone": [0.0, 1.0], "same": [1.0, 0.0]}
    reward = grader_reward(multi, RecordingJudge("flat", "what"))
    assert reward(prompts=["p", "q"], completions=["a", "b"]) == [1.0, 0.0]  # an ungradable sample gets 0
    assert reward.grading_errors == {"model_grader_parse_error": 1}
    assert [g.where for g in multi.walk()] == ["grader", "grader.graders.tone", "grader.graders.same"]


def test_a_grader_as_a_grpo_reward_function():
    reward = grader_reward(string_check("ilike"))
    assert reward.__name__ == "check"
    completions = ["paris", [{"role": "assistant", "content": "Lyon"}]]
    assert reward(prompts=["q1", "q2"], completions=completions, completion_ids=[[1], [2]],
                  answer=["Paris", "Paris"]) == [1.0, 0.0]
