import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest

from evals.judge import (JudgeItem, JudgeUnavailableError, LocalHFJudge, OpenAICompatibleJudge, judge_answers,
                         load_judge_templates, load_mt_bench_questions, mt_bench_items, parse_rating,
                         render_judge_prompt, strip_reasoning)
from tiny_configs import tiny_model, tiny_tokenizer
from translators.errors import ConfigError, PrefixTooLongError

SHORT_TEMPLATES = [
    {"name": "single-v1", "type": "single", "system_prompt": "w1", "output_format": "[[rating]]",
     "prompt_template": "w2 {question} w3 {answer}"},
    {"name": "single-math-v1", "type": "single", "system_prompt": "w1", "output_format": "[[rating]]",
     "prompt_template": "w2 {question} w4 {ref_answer_1} w3 {answer}"},
]


@pytest.fixture
def short_templates(tmp_path):
    path = tmp_path / "judge_prompts.jsonl"
    path.write_text("\n".join(json.dumps(t) for t in SHORT_TEMPLATES) + "\n")
    return load_judge_templates(path)


@pytest.fixture
def mt_templates(shared_data):
    return load_judge_templates(shared_data / "mt_bench" / "judge_prompts.jsonl")


# --- parsing --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("The answer is helpful. Rating: [[8]]", 8.0),
    ("[[8.5]]", 8.5),
    ("Rating: [[ 9 ]]", 9.0),
    ("Rating: [[10]]", 10.0),
    ("Rating: [[1]]", 1.0),
    ("Format example: Rating: [[5]]. My verdict: Rating: [[7]]", 7.0),
    ("<think>maybe [[3]]</think>Rating: [[6]]", 6.0),
    ("Rating: [[rating]]", None),
    ("The essay mentions [[1996]]", None),
    ("Rating: [[0]]", None),
    ("Rating: [[11]]", None),
    ("Rating: 8/10", None),
    ("Rating: [8]", None),
    ("", None),
])
def test_parse_rating(text, expected):
    assert parse_rating(text) == expected


def test_strip_reasoning():
    assert strip_reasoning("<think>\nlong\n</think>\n\nParis.") == "Paris."
    assert strip_reasoning("Paris. <think>unfinished") == "Paris."


# --- templates and items --------------------------------------------------------------------------------------


def test_mt_bench_templates_and_rendering(mt_templates):
    assert mt_templates["single-v1"].output_format == "[[rating]]"
    system, user = render_judge_prompt(JudgeItem("What is 2+2?", "<think>hmm</think>It is 4."), mt_templates)
    assert system == mt_templates["single-v1"].system_prompt
    assert "[Question]\nWhat is 2+2?" in user and "It is 4." in user and "hmm" not in user
    _, user = render_judge_prompt(JudgeItem("What is 2+2?", "5", reference="4"), mt_templates)
    assert "[The Start of Reference Answer]\n4\n" in user and "reference answer" in user


def test_mt_bench_questions_and_references(shared_data):
    root = shared_data / "mt_bench"
    questions = load_mt_bench_questions(root / "question.jsonl", root / "reference_answer" / "gpt-4.jsonl")
    assert len(questions) == 80 and all(len(q.turns) == 2 for q in questions)
    with_ref = [q for q in questions if q.reference]
    assert len(with_ref) == 30 and {q.category for q in with_ref} == {"math", "reasoning", "coding"}
    items = mt_bench_items(questions, {q.question_id: "an answer" for q in questions[:5]} | {101: "second"})
    assert len(items) == 6 and items[-1].reference is not None and items[0].reference is None
    assert len(load_mt_bench_questions(root / "question.jsonl", limit=3)) == 3


def test_missing_template_file_and_templates(tmp_path):
    with pytest.raises(ConfigError, match=str(tmp_path / "none.jsonl")):
        load_judge_templates(tmp_path / "none.jsonl")
    path = tmp_path / "judge_prompts.jsonl"
    path.write_text(json.dumps(SHORT_TEMPLATES[0]) + "\n")
    with pytest.raises(ConfigError, match="single-math-v1"):
        load_judge_templates(path)


class _CannedJudge:
    def __init__(self, verdicts):
        self.verdicts, self.prompts = list(verdicts), []

    def complete(self, system, user):
        self.prompts.append((system, user))
        return self.verdicts.pop(0)


def test_judge_answers_counts_unparseable(short_templates):
    judge = _CannedJudge(["Rating: [[4]]", "no verdict", "Rating: [[6]]"])
    items = [JudgeItem("q1", "a1", id="1"), JudgeItem("q2", "a2", id="2"), JudgeItem("q3", "a3", reference="r3", id="3")]
    result = judge_answers(judge, items, short_templates)
    assert result.ratings == {"1": 4.0, "2": None, "3": 6.0} and result.n_unparseable == 1 and result.n == 2
    assert result.scores() == {"1": 4.0, "3": 6.0} and result.verdicts["2"] == "no verdict"
    assert result.mean == 5.0 and result.se == pytest.approx(1.0)  # std([4, 6]) / sqrt(2)
    assert judge.prompts[2] == ("w1", "w2 q3 w4 r3 w3 a3")
    with pytest.raises(ConfigError, match="no items"):
        judge_answers(judge, [], short_templates)
    with pytest.raises(ConfigError, match=r"distinct ids.*\['7'\]"):
        judge_answers(judge, [JudgeItem("q1", "a1", id="7"), JudgeItem("q2", "a2", id="7")], short_templates)


# --- OpenAI-compatible endpoint -------------------------------------------------------------------------------


class _FakeServer:
    """A chat-completions server on 127.0.0.1 answering a fixed list of canned replies, one per request."""

    def __init__(self, replies):
        self.requests = []
        replies, requests = list(replies), self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                requests.append({"path": self.path, "body": json.loads(body),
                                 "auth": self.headers.get("Authorization")})
                status, payload = replies.pop(0)
                data = payload if isinstance(payload, bytes) else json.dumps(
                    {"choices": [{"index": 0, "message": {"role": "assistant", "content": payload}}]}).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.server.timeout = 5  # handle_request gives up after 5 s without a request
        n = len(replies)
        # Bounded: serves exactly n requests (or times out on each), then the thread ends.
        self.thread = threading.Thread(target=lambda: [self.server.handle_request() for _ in range(n)], daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self):
        self.thread.join(timeout=30)
        self.server.server_close()


@pytest.fixture
def fake_server():
    servers = []

    def start(replies):
        servers.append(_FakeServer(replies))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def test_openai_compatible_judge_parses_verdicts(fake_server, mt_templates):
    server = fake_server([(200, "Helpful and correct. Rating: [[8]]"), (200, "Rating: [[8.5]]"),
                          (200, "I cannot judge this."), (200, "Rating: [[1996]]")])
    items = [JudgeItem("Name a primary colour.", "Red is one.", id="81"), JudgeItem("q2", "a2", id="82"),
             JudgeItem("q3", "a3", id="83"), JudgeItem("What is 3*4?", "12", reference="3*4 = 12", id="84")]
    with OpenAICompatibleJudge(server.url, "judge-model", api_key="sk-test", timeout=10) as judge:
        result = judge_answers(judge, items, mt_templates)
    assert result.ratings == {"81": 8.0, "82": 8.5, "83": None, "84": None} and result.n_unparseable == 2
    assert result.mean == 8.25 and result.se == pytest.approx(0.25)
    first = server.requests[0]
    assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer sk-test"
    body = first["body"]
    assert body["model"] == "judge-model" and body["temperature"] == 0.0
    assert body["messages"][0] == {"role": "system", "content": mt_templates["single-v1"].system_prompt}
    assert body["messages"][1]["content"] == mt_templates["single-v1"].prompt_template.format(
        question="Name a primary colour.", answer="Red is one.")
    math_prompt = server.requests[3]["body"]["messages"][1]["content"]
    assert "3*4 = 12" in math_prompt and "[The Start of Reference Answer]" in math_prompt


def test_http_errors_and_malformed_bodies_raise_unavailable(fake_server):
    server = fake_server([(500, b'{"error": "model not loaded"}'), (200, b"not json")])
    judge = OpenAICompatibleJudge(server.url, "m", timeout=10)
    with pytest.raises(JudgeUnavailableError, match="HTTP 500.*model not loaded"):
        judge.complete("s", "u")
    with pytest.raises(JudgeUnavailableError, match="did not return a chat completion"):
        judge.complete("s", "u")
    judge.close()


def _closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_endpoint_down_raises_judge_unavailable(short_templates):
    url = f"http://127.0.0.1:{_closed_port()}/v1"
    judge = OpenAICompatibleJudge(url, "m", timeout=5, retries=0)
    start = time.monotonic()
    with pytest.raises(JudgeUnavailableError) as err:
        judge_answers(judge, [JudgeItem("q", "a")], short_templates)
    assert time.monotonic() - start < 5  # refused at once, not waited out
    assert url + "/chat/completions" in str(err.value) and "ConnectError" in str(err.value)
    assert isinstance(err.value, ConfigError)


def test_bad_judge_settings():
    with pytest.raises(ConfigError, match="http"):
        OpenAICompatibleJudge("127.0.0.1:8000", "m")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        LocalHFJudge(None, None, max_new_tokens=0)


# --- local transformers judge ---------------------------------------------------------------------------------


def test_local_hf_judge_garbage_is_counted_unparseable(short_templates):
    judge = LocalHFJudge(tiny_model("llama"), tiny_tokenizer(), max_new_tokens=4)
    items = [JudgeItem("w5 w6", "w7", id="1"), JudgeItem("w8", "w9", reference="w10", id="2")]
    result = judge_answers(judge, items, short_templates)
    assert result.n_unparseable == 2 and result.ratings == {"1": None, "2": None}
    assert result.mean is None and result.se is None and result.n == 0
    for verdict in result.verdicts.values():
        assert 1 <= len(verdict.split()) <= 4  # greedy, at most max_new_tokens word tokens
    assert judge_answers(judge, items, short_templates).verdicts == result.verdicts  # greedy is deterministic


def test_local_hf_judge_uses_the_chat_template():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}w1 {{ m.content }} {% endfor %}w2"
    judge = LocalHFJudge(tiny_model("llama"), tokenizer, max_new_tokens=2)
    ids = judge._input_ids("w3", "w4 w5")
    assert tokenizer.decode(ids[0]) == "w1 w3 w1 w4 w5 w2"


def test_local_hf_judge_refuses_prompts_beyond_the_models_positions(short_templates):
    judge = LocalHFJudge(tiny_model("llama"), tiny_tokenizer(), max_new_tokens=4)
    with pytest.raises(PrefixTooLongError, match="128 positions"):
        judge_answers(judge, [JudgeItem("w5", "w6 " * 130)], short_templates)
