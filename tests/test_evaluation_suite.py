"""The instruction-tuning benchmark suite (peft_sparse.evaluation.suite): prompts, answer extraction, metrics,
the sandboxed HumanEval runner, and the HF model adapter on a tiny model."""

import pytest
import torch

from peft_sparse.evaluation import suite

from .models import tiny_llama, tiny_tokenizer


class Scripted:
    """A stand-in model: replies chosen by a function of the prompt; records what it was asked."""

    def __init__(self, reply, choice=None):
        self.reply, self.choice, self.prompts, self.calls = reply, choice, [], []

    def generate(self, prompts, max_new_tokens, temperature=0.0, stop=None):
        self.prompts += list(prompts)
        self.calls.append({"max_new_tokens": max_new_tokens, "temperature": temperature, "stop": stop})
        return [self.reply(p) for p in prompts]

    def choice_logprobs(self, prompt, options):
        self.prompts.append(prompt)
        return self.choice(prompt, options)


def test_mmlu_is_five_shot_letter_scoring_per_subject():
    dev = [{"subject": "astronomy", "question": f"dev q{i}", "choices": ["a", "b", "c", "d"], "answer": i % 4} for i in range(6)]
    rows = [{"subject": "astronomy", "question": f"q{i}", "choices": ["w", "x", "y", "z"], "answer": i % 4} for i in range(4)]
    # the stand-in knows the answers of q0 and q1 only (by the question in the prompt's last block)
    known = {"q0": 0, "q1": 1}

    def choice(prompt, options):
        assert options == [" A", " B", " C", " D"]
        last = prompt.rsplit("\n\n", 1)[-1]
        q = last.split("\n")[0]
        return [1.0 if known.get(q) == i else 0.0 for i in range(4)] if q in known else [0.0, 0.1, 0.0, 0.0]

    model = Scripted(None, choice)
    result = suite.mmlu(model, rows, dev)
    assert result["total"] == 4 and result["accuracy"] == pytest.approx(0.5)  # q0 right, q1 right, q2/q3 answer B: wrong
    prompt = model.prompts[0]
    assert prompt.startswith("The following are multiple choice questions (with answers) about astronomy.")
    assert prompt.count("Answer:") == 6 and "dev q4" in prompt and "dev q5" not in prompt  # exactly 5 shots
    assert prompt.endswith("q0\nA. w\nB. x\nC. y\nD. z\nAnswer:")


def test_gsm_takes_the_last_number_and_is_eight_shot():
    exemplars = [{"question": f"e{i}", "answer": f"work {i} #### {i}"} for i in range(10)]
    rows = [{"question": "How many?", "answer": "1+1=2 #### 1,200"}, {"question": "And now?", "answer": "#### -3.5"}]
    model = Scripted(lambda p: "we get 1,200 apples. So 1200" if "How many" in p else "it is 3.5")
    result = suite.gsm(model, rows, exemplars)
    assert result == {"exact_match": 0.5, "total": 2}
    assert model.prompts[0].count("Question:") == 9 and "So the answer is 7." in model.prompts[0] and "e8" not in model.prompts[0]
    assert suite.last_number("x = 1,234.50.") == "1234.5" and suite.last_number("none") is None
    assert model.calls[0]["temperature"] == 0.0


def test_bbh_exact_match_after_so_the_answer_is():
    rows = [{"input": f"i{i}", "target": "(A)" if i % 2 else "True"} for i in range(8)]
    model = Scripted(lambda p: "Let's think. So the answer is (A)." if p.endswith("Q: i3\nA:") else "False\nmore text")
    result = suite.bbh(model, {"logic": rows}, shots=3, per_task=4)
    assert result["per_task"]["logic"] == pytest.approx(0.25)  # i3 right; i4 (True) gets False; i5/i6 wrong
    assert suite.bbh_answer("So the answer is No.") == "No" and suite.bbh_answer("yes\nbecause") == "yes"


def test_tydiqa_f1_is_squad_token_f1_per_language():
    assert suite.f1("The Eiffel tower!", "eiffel tower") == 1.0
    assert suite.f1("Paris France", "Paris") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    rows = [{"id": f"swahili-{i}", "context": "c", "question": f"q{i}", "answers": {"text": [f"ans {i}", "x"]}} for i in range(3)]
    rows += [{"language": "finnish", "context": "c", "question": "f", "answers": {"text": ["yes"]}}, {"language": "finnish", "context": "c", "question": "g", "answers": {"text": ["no"]}}]
    model = Scripted(lambda p: "ans 1" if p.endswith("q1\nAnswer:") else "no")
    result = suite.tydiqa(model, rows, per_language=100, shots=1)
    assert result["per_language"] == {"finnish": 1.0, "swahili": pytest.approx(0.5)}
    assert any(p.startswith("Passage: c\nQuestion: q0\nAnswer: ans 0\n\n") for p in model.prompts)  # the 1 shot carries its answer


def test_humaneval_runs_programs_in_a_limited_process():
    rows = [
        {"prompt": "def add(a, b):\n", "test": "def check(f):\n    assert f(2, 3) == 5", "entry_point": "add"},
        {"prompt": "def sub(a, b):\n", "test": "def check(f):\n    assert f(2, 3) == -1", "entry_point": "sub"},
    ]
    model = Scripted(lambda p: "    return a + b\n")
    result = suite.humaneval(model, rows, allow_code_execution=True)
    assert result == {"pass@1": 0.5, "total": 2} and model.calls[0]["temperature"] == 0.1
    assert suite.run_program("import sys; print('ran')") and not suite.run_program("raise SystemExit(3)")
    assert not suite.run_program("import sys; sys.exit(0)")  # (an early exit skips the tests: not a pass)
    assert not suite.run_program("while True: pass", timeout=2.0)  # wall clock
    assert not suite.run_program("x = bytearray(4 * 2**30)", memory_mb=512)  # memory limit
    assert suite.run_program("import os; assert 'PYTHONPATH' not in os.environ and os.getcwd().startswith('/tmp')")


def test_load_task_reads_local_files_and_refuses_the_hub_offline(tmp_path, monkeypatch):
    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "q", "answer": "#### 1"}\n')
    assert suite.load_task("gsm", str(path)) == [{"question": "q", "answer": "#### 1"}]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="gsm: openai/gsm8k is a hub dataset, but the hub is switched off here"):
        suite.load_task("gsm")
    with pytest.raises(ValueError, match="unknown task 'arc'"):
        suite.load_task("arc")


def test_hf_model_adapter_generates_and_scores_on_a_tiny_model():
    tok = tiny_tokenizer()
    model = suite.HFModel(tiny_llama(), tok, batch_size=2)
    replies = model.generate(["t5 t6", "t7", "t8 t9 t10"], max_new_tokens=3)
    assert len(replies) == 3 and all(isinstance(r, str) for r in replies)
    scores = model.choice_logprobs("t5 t6", ["t7", "t8"])
    with torch.no_grad():
        logits = tiny_llama()(torch.tensor([[5, 6]])).logits[0, -1].log_softmax(-1)
    assert scores == pytest.approx([float(logits[7]), float(logits[8])], abs=1e-5)
    again = suite.HFModel(tiny_llama(), tok, seed=3).generate(["t5"], 4, temperature=0.1)
    assert again == suite.HFModel(tiny_llama(), tok, seed=3).generate(["t5"], 4, temperature=0.1)


def test_cli_evaluates_a_local_task_file(tmp_path, capsys, monkeypatch):
    import json

    from peft_sparse import cli
    from peft_sparse.evaluation import suite as module

    rows = [{"prompt": "def f():\n", "test": "def check(g):\n    assert g() == 1", "entry_point": "f"}]
    (tmp_path / "he.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(module, "HFModel", lambda model, tok, **kw: Scripted(lambda p: "    return 1\n"))
    monkeypatch.setattr("peft_sparse.assets.load_model_and_tokenizer", lambda *a, **k: (None, None))
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    assert cli.main(["evaluate", "humaneval", "--base", "x", "--data", str(tmp_path / "he.jsonl"), "--allow-code-execution"]) == 0
    assert json.loads(capsys.readouterr().out)["pass@1"] == 1.0


def test_humaneval_runs_model_written_code_only_when_the_user_opts_in(tmp_path, capsys, monkeypatch):
    """As evaluate's code_eval: refused, saying why, unless --allow-code-execution / allow_code_execution=True or
    HF_ALLOW_CODE_EVAL=1; the command refuses before it loads a model."""
    import json

    from peft_sparse import cli

    rows = [{"prompt": "def f():\n", "test": "def check(g):\n    assert g() == 1", "entry_point": "f"}]
    (tmp_path / "he.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.delenv("HF_ALLOW_CODE_EVAL", raising=False)
    model = Scripted(lambda p: "    return 1\n")
    with pytest.raises(ValueError, match="runs the programs the model writes.*--allow-code-execution.*HF_ALLOW_CODE_EVAL=1"):
        suite.humaneval(model, rows)
    with pytest.raises(ValueError, match="HF_ALLOW_CODE_EVAL=1"):
        suite.run_task("humaneval", model, rows)
    assert model.calls == []  # (refused before generating)
    loaded = []
    monkeypatch.setattr("peft_sparse.assets.load_model_and_tokenizer", lambda *a, **k: loaded.append(1) or (None, None))
    assert cli.main(["evaluate", "humaneval", "--base", "x", "--data", str(tmp_path / "he.jsonl")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--allow-code-execution" in err and "not a security boundary" in err and not loaded
    monkeypatch.setenv("HF_ALLOW_CODE_EVAL", "1")
    assert suite.humaneval(model, rows)["pass@1"] == 1.0


@pytest.mark.parametrize(
    "attempt",
    [
        "import os; os.system('touch {marker}')",
        "import subprocess; subprocess.run(['touch', '{marker}'])",
        "import subprocess; subprocess.Popen(['touch', '{marker}']).wait()",
        "import os; os.popen('touch {marker}').read()",
        "import os\nif os.fork() == 0:\n    open('{marker}', 'w').close()",
        "import os; os.execv('/usr/bin/touch', ['touch', '{marker}'])",
        "import os; os.posix_spawn('/usr/bin/touch', ['touch', '{marker}'], {{}})",
        "import os; os.spawnv(os.P_WAIT, '/usr/bin/touch', ['touch', '{marker}'])",
        "import multiprocessing as mp, pathlib\nif __name__ == '__main__':\n    p = mp.get_context('spawn').Process(target=pathlib.Path('{marker}').touch)\n    p.start(); p.join()",
        "import os; os.remove('{victim}')",
        "import os; os.unlink('{victim}')",
        "import pathlib; pathlib.Path('{victim}').unlink()",
        "import os; os.rename('{victim}', '{marker}')",
        "import os; os.replace('{victim}', '{marker}')",
        "import os; os.truncate('{victim}', 0)",
        "import os; os.chmod('{victim}', 0)",
        "import os; os.rmdir('{empty}')",
        "import os; os.removedirs('{empty}')",
        "import shutil; shutil.rmtree('{folder}')",
        "import shutil; shutil.move('{victim}', '{marker}')",
        "import os, signal; os.kill({sleeper}, signal.SIGTERM)",
        "import os, signal; os.killpg({sleeper}, signal.SIGTERM)",
        "import os; os.putenv('X', '1')",
        "import socket; socket.socket(socket.AF_INET, socket.SOCK_STREAM).connect(('127.0.0.1', {port}))",
        "import socket; socket.create_connection(('127.0.0.1', {port}))",
        "import os; os._exit(0)",
        "exit(0)",
    ],
)
def test_humaneval_programs_cannot_spawn_remove_or_connect(tmp_path, attempt):
    """Before a model-written program runs, the child disables what the reference HumanEval harness disables
    (process creation, os.system, file and directory removal, renaming, mode changes, signals, the environment) and
    network sockets: each attempt fails the program and leaves no trace."""
    import socket
    import subprocess

    victim, folder, marker = tmp_path / "victim.txt", tmp_path / "folder", tmp_path / "marker"
    victim.write_text("keep")
    (tmp_path / "empty").mkdir()
    folder.mkdir()
    (folder / "inside.txt").write_text("keep")
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.setblocking(False)
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)  # (a process to signal)
    try:
        program = attempt.format(marker=marker, victim=victim, folder=folder, empty=tmp_path / "empty", port=server.getsockname()[1], sleeper=sleeper.pid)
        assert not suite.run_program(program + "\nprint('the attempt went through')", timeout=20.0)
        with pytest.raises(BlockingIOError):
            server.accept()  # (nobody connected)
        assert sleeper.poll() is None  # (still running)
    finally:
        server.close()
        sleeper.kill()
        sleeper.wait()
    assert not marker.exists() and victim.read_text() == "keep" and (folder / "inside.txt").read_text() == "keep" and (tmp_path / "empty").is_dir()
    assert oct(victim.stat().st_mode & 0o777) != "0o0"
