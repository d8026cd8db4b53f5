"""``train.serve``: the official ``openai`` client against a live server on a free loopback port, every bad request
answered with a 4xx while the server goes on, eight concurrent clients all answered, a client gone mid-stream freeing
the decoder, and the page in a real browser (Playwright driving the system's Chromium, where one is installed)."""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(decoding_run):
    """The tiny run served by uvicorn in a thread; its base URL. Stopped (and its worker closed) after the module."""
    import uvicorn

    from mcfn.serve.app import build_app
    from train.serve import served_run

    run, _ = decoding_run
    args = argparse.Namespace(ckpt=run, max_tokens=64, max_prompt_tokens=2000, device="cpu", compile=False)
    served = served_run(args)
    served.worker.start()
    port = free_port()
    config = uvicorn.Config(build_app(served), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert uv.started, "the server did not start"
    yield f"http://127.0.0.1:{port}", served
    uv.should_exit = True
    thread.join(timeout=10)
    served.worker.close()


@pytest.fixture(scope="module")
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120)


PROMPT = "the old town by the sea " * 12


@pytest.mark.heavy(20)
def test_the_openai_client_completes_names_the_model_and_counts_usage(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [server[1].model_name]
    answer = client.completions.create(model=server[1].model_name, prompt=PROMPT, max_tokens=12, temperature=0)
    assert answer.object == "text_completion" and answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 12
    tok = server[1].worker.tok
    assert answer.usage.prompt_tokens == 1 + len(tok.encode(PROMPT))
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + 12
    assert answer.choices[0].text


@pytest.mark.heavy(20)
def test_a_streamed_completion_joins_to_the_completion_under_the_same_seed(server, client):
    kwargs = dict(model="any", prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    whole = client.completions.create(**kwargs)
    pieces, finish, used = [], None, None
    for part in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if part.choices:
            pieces.append(part.choices[0].text)
            finish = part.choices[0].finish_reason or finish
        if part.usage is not None:
            used = part.usage
    assert "".join(pieces) == whole.choices[0].text and finish == "length"
    assert used is not None and used.completion_tokens == whole.usage.completion_tokens == 16


@pytest.mark.heavy(20)
def test_a_stop_sequence_ends_the_text_before_it(server, client):
    free = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), "the free text's middle should hold a visible stop string"
    stopped = client.completions.create(model="m", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == free[: free.index(stop)]


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"prompt": "", "max_tokens": 4}, 400, "empty prompt"),
        ({"prompt": "   ", "max_tokens": 4}, 400, "empty prompt"),
        ({"prompt": 12345, "max_tokens": 4}, 400, "prompt"),
        ({"prompt": {"text": "a"}, "max_tokens": 4}, 400, "prompt"),
        ({"prompt": "the sea", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "the sea", "max_tokens": -3}, 400, "max_tokens"),
        ({"prompt": "the sea", "max_tokens": 65}, 400, "between 1 and 64"),
        ({"prompt": "the sea " * 3000, "max_tokens": 4}, 413, "over this server's 2000"),
        ({"prompt": "the sea", "context": "nonsense"}, 400, "unknown focus policy 'nonsense'"),
        ({"prompt": "the sea", "temperature": 9}, 400, "temperature"),
        ({"prompt": "the sea", "n": 3}, 400, "n"),
    ],
)
def test_a_bad_request_gets_a_4xx_saying_what_is_wrong_and_the_server_goes_on(server, body, status, says):
    url = server[0]
    answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert answer.status_code == status
    error = answer.json()["error"]
    assert says in error["message"] and error["type"] == "invalid_request_error"
    still = httpx.post(f"{url}/v1/completions", json={"prompt": "the sea", "max_tokens": 2}, timeout=60)
    assert still.status_code == 200 and still.json()["usage"]["completion_tokens"] == 2


def test_malformed_json_gets_a_400(server):
    answer = httpx.post(
        f"{server[0]}/v1/completions", content=b'{"prompt": "a", ', headers={"Content-Type": "application/json"}
    )
    assert answer.status_code == 400 and "JSON" in answer.json()["error"]["message"]


@pytest.mark.heavy(25)
def test_eight_concurrent_clients_are_all_answered(server, client):
    def ask(i: int):
        return client.completions.create(model="m", prompt=f"{PROMPT} {i}", max_tokens=6, temperature=0.5, seed=i)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert [a.usage.completion_tokens for a in answers] == [6] * 8
    assert len({a.id for a in answers}) == 8


@pytest.mark.heavy(20)
def test_a_client_gone_mid_stream_frees_the_decoder(server):
    url, served = server
    body = {"prompt": PROMPT, "max_tokens": 64, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and '"text": "' in line and '"text": ""' not in line:
                break  # one token read, then the client goes away
    start = time.monotonic()
    after = httpx.post(f"{url}/v1/completions", json={"prompt": "the sea", "max_tokens": 2}, timeout=60)
    assert after.status_code == 200
    assert served.worker.jobs.qsize() == 0 and time.monotonic() - start < 30


@pytest.mark.heavy(20)
def test_the_stream_carries_each_refocus_layout_and_the_figures(server):
    body = {"prompt": PROMPT, "max_tokens": 12, "stream": True, "temperature": 0}
    events = []
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
    refocuses = [e["mcfn"]["refocus"] for e in events if "refocus" in e.get("mcfn", {})]
    figures = [e["mcfn"]["figures"] for e in events if "figures" in e.get("mcfn", {})]
    assert refocuses and all(set(r["layout"]) <= set("0123456789·") for r in refocuses)
    assert len(figures) == 1 and figures[0]["refocuses"] == len(refocuses)
    assert figures[0]["refocuses_per_token"] == pytest.approx(len(refocuses) / 12)


@pytest.mark.heavy(20)
def test_a_copy_names_where_it_reads_from(server):
    """A prompt that ends by starting to repeat an earlier, distinct stretch: the first decoded token's event names
    that stretch's continuation in the prompt as the copy's source (the refocus watch's index, not the model)."""
    tok = server[1].worker.tok
    stretch = "quiet harbour lanterns drift past"
    prompt = f"{stretch} over the water. " + "the old town by the sea " * 6 + stretch.rsplit(" ", 2)[0]
    body = {"prompt": prompt, "max_tokens": 2, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server[0]}/v1/completions", json=body, timeout=60) as response:
        copies = [
            json.loads(line[len("data: ") :])["mcfn"]["copy"]
            for line in response.iter_lines()
            if line.startswith("data: ") and '"copy"' in line
        ]
    n = 1 + len(tok.encode(prompt))
    first_stretch = 1 + len(tok.encode(stretch))  # BOS, then the stretch
    assert copies and copies[0] and all(0 < p < first_stretch <= n for p in copies[0])


@pytest.mark.heavy(25)
def test_train_serve_answers_stops_on_ctrl_c_and_says_when_its_port_is_taken(decoding_run, server):
    """``python -m train.serve`` as a user runs it (decoding on its main thread, HTTP on another): it answers a
    completion and exits 0 on Ctrl-C; started on a port already served, it exits 2 saying it could not serve."""
    import signal
    import subprocess
    import sys

    run, _ = decoding_run
    port = free_port()
    command = [sys.executable, "-X", "faulthandler", "-m", "train.serve", "--ckpt", str(run), "--threads", "1"]
    # Ctrl-C reaches the server as it would from a terminal: a shell's background job (this suite run with `&`) has
    # SIGINT ignored, and a child inherits that; a Python handler in the parent is reset to the default at exec.
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        serving = subprocess.Popen([*command, "--port", str(port)], stderr=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0}
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 3
        serving.send_signal(signal.SIGINT)
        try:
            code = serving.wait(timeout=30)
        except subprocess.TimeoutExpired:  # where it hangs: faulthandler prints every thread's stack on SIGABRT
            serving.send_signal(signal.SIGABRT)
            pytest.fail(f"train.serve still ran 30 s after Ctrl-C:\n{serving.communicate(timeout=30)[1]}")
        assert code == 0, serving.stderr.read()
    finally:
        serving.kill()
    taken = int(server[0].rsplit(":", 1)[1])
    refused = subprocess.run([*command, "--port", str(taken)], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and f"could not serve on 127.0.0.1:{taken}" in refused.stderr


class Immediate:
    """An event loop stand-in that runs what it is handed at once, on the caller's thread."""

    def call_soon_threadsafe(self, fn, *args):
        fn(*args)


def test_the_relay_holds_text_for_at_most_its_interval_and_sends_other_events_at_once():
    """Text decoded within RELAY_S of the last batch waits; the first piece, a piece after the interval, a refocus
    and the end each send everything held, in order. Fails with every event sent alone, or held ones dropped."""
    import asyncio

    from mcfn.serve.app import RELAY_S, Relay
    from mcfn.serve.worker import Event

    events: asyncio.Queue = asyncio.Queue()
    now = [0.0]
    relay = Relay(Immediate(), events, clock=lambda: now[0])

    def text(i: int) -> Event:
        return Event("text", {"text": str(i)})

    def sent() -> list[str]:
        out = []
        while not events.empty():
            e = events.get_nowait()
            out.append(e.data.get("text", e.kind))
        return out

    relay(text(0))
    assert sent() == ["0"], "the first piece goes at once"
    now[0] += RELAY_S / 4
    relay(text(1))
    relay(text(2))
    assert sent() == [], "pieces within the interval wait"
    relay(Event("refocus", {}))
    assert sent() == ["1", "2", "refocus"]
    now[0] += RELAY_S
    relay(text(3))
    assert sent() == ["3"], "a piece after the interval goes with what is held"
    now[0] += RELAY_S / 2
    relay(text(4))
    relay(Event("done", {}))
    assert sent() == ["4", "done"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.heavy(30)
@pytest.mark.skipif(chromium() is None, reason="no Chromium on this machine (apt-get install chromium runs this test)")
def test_the_page_loads_generates_and_draws_the_strip(server, tmp_path):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(server[0] + "/")
        page.wait_for_function("document.getElementById('context').options.length > 1")
        page.fill("#prompt", PROMPT * 3)
        page.fill("#max_tokens", "24")
        page.click("#generate")
        page.wait_for_function("document.getElementById('status').textContent.startsWith('done')", timeout=60_000)
        assert page.inner_text("#generated").strip()
        assert page.inner_text("#rpt") not in ("", "–")
        drawn = page.evaluate(
            """() => { const c = document.getElementById('strip'); const d = c.getContext('2d')
                .getImageData(0, 0, c.width, c.height).data; let coloured = 0;
                for (let i = 0; i < d.length; i += 4)
                  if (!(d[i] === 255 && d[i + 1] === 255 && d[i + 2] === 255)) coloured++;
                return coloured; }"""
        )
        assert drawn > 100, "the strip holds no coloured block"
        shot = tmp_path / "page.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        browser.close()
