"""The service as processes (CPU, embedded model): the launcher, one engine core and its HTTP front-ends over
ZeroMQ. Two front-ends serve one core; a storm of clients that leave mid-stream leaves no KV block in use; a killed
engine core fails its requests cleanly, /health turns 503 and the launcher exits non-zero for its supervisor; a drain
keeps answering new connections (429, /health 503) until its requests end, and nothing in flight ends it at once; a
core that cannot load its model, or a front-end waiting for one, stops at once."""
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from server import ROOT, launch_command, scrape, service_process, sse_events

from service.config import DEFAULT_MODEL_DIR

LONG = {"inputs": "A man walks into a bar", "parameters": {"max_new_tokens": 1500, "ignore_eos": True}}


def children(pid: int) -> dict[str, int]:
    """{process name (comm): pid} of the launcher's children."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:  # ppid
                found[(stat.parent / "comm").read_text().strip()] = int(stat.parent.name)
        except (OSError, IndexError, ValueError):
            continue
    return found


def engine_stats(url: str) -> dict:
    m = scrape(url)
    core = (("engine", "0"),)
    return {"running": m[("llm_requests_running", core)], "waiting": m[("llm_requests_waiting", core)],
            "kv": m[("llm_kv_cache_usage_ratio", core)]}


def wait_idle(url: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while (stats := engine_stats(url)) != {"running": 0, "waiting": 0, "kv": 0} and time.monotonic() < deadline:
        time.sleep(0.05)
    return stats


def test_two_front_ends_serve_one_engine_core():
    with service_process(api_server_count=2, log_level="info") as service:
        names = children(service.process.pid)
        assert {"llm-engine-core", "llm-api-0", "llm-api-1"} <= set(names), names

        async def one(i):
            # a connection each: the kernel spreads them over the front-ends sharing the port
            async with httpx.AsyncClient(base_url=service.url, timeout=60) as client:
                r = await client.post("/generate", json={"inputs": f"fortune {i}", "parameters": {"max_new_tokens": 4}})
                return r.status_code

        async def run():
            return await asyncio.gather(*(one(i) for i in range(48)))

        assert asyncio.run(run()) == [200] * 48
        log = service.log.read_text(errors="replace")
        served_by = {name for name in ("llm-api-0", "llm-api-1") if f"{name} service.api: request_id" in log}
        assert served_by == {"llm-api-0", "llm-api-1"}
        # one /metrics, whichever front-end answers it, adds up both front-ends' requests
        for _ in range(4):
            m = scrape(service.url)
            assert m[("llm_requests_total", (("endpoint", "generate"), ("outcome", "success")))] == 48


def test_a_storm_of_clients_leaving_mid_stream_leaves_no_block_in_use():
    with service_process(api_server_count=2) as service:
        async def leave_after(client, n):
            async with client.stream("POST", "/generate_stream", json=LONG) as r:
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data:")
                    if seen >= n:
                        return  # closes the connection mid-stream

        async def run():
            async with httpx.AsyncClient(base_url=service.url, timeout=60,
                                         limits=httpx.Limits(max_connections=100)) as client:
                await asyncio.gather(*(leave_after(client, 1 + i % 5) for i in range(60)))

        asyncio.run(run())
        assert wait_idle(service.url) == {"running": 0, "waiting": 0, "kv": 0}
        m = scrape(service.url)
        aborted = m[("llm_requests_total", (("endpoint", "generate_stream"), ("outcome", "aborted")))]
        assert aborted == 60 and httpx.get(f"{service.url}/health").status_code == 200


def test_a_killed_engine_core_fails_requests_and_the_service_exits_non_zero():
    with service_process() as service:
        core = children(service.process.pid)["llm-engine-core"]
        results = {}

        def stream():
            with httpx.stream("POST", f"{service.url}/generate_stream", json=LONG, timeout=60) as r:
                events = []
                for data in sse_events(r):
                    events.append(json.loads(data))
                    if len(events) == 3:
                        os.kill(core, signal.SIGKILL)
                results["stream"] = events

        stream()
        last = results["stream"][-1]
        assert last.get("error_type") == "generation" and "engine core" in last["error"], last
        health = httpx.get(f"{service.url}/health")
        assert health.status_code == 503
        r = httpx.post(f"{service.url}/generate", json={"inputs": "a"})
        assert r.status_code == 503 and r.json()["error_type"] == "unavailable"
        assert service.process.wait(timeout=30) == 1
        assert "llm-engine-core exited" in service.log.read_text(errors="replace")


def wait_draining(url: str, timeout: float = 10) -> None:
    """Until the front-end has handled a signal: /health says 503 to a new connection."""
    deadline = time.monotonic() + timeout
    while httpx.get(f"{url}/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.parametrize("how", ["sigterm", "sigint", "sigint_after_launchers_sigterm"])
def test_a_signal_drains_the_requests_in_flight_then_stops_cleanly(how):
    # One front-end: the one signalled first is the one serving the stream (on a host of many cores the launcher
    # starts several, and another one's drain ends at once, which the launcher takes for a crash).
    with service_process(api_server_count=1) as service:
        body = {"inputs": "A man walks into a bar", "parameters": {"max_new_tokens": 150, "ignore_eos": True}}
        with httpx.stream("POST", f"{service.url}/generate_stream", json=body, timeout=60) as r:
            events = sse_events(r)
            first = json.loads(next(events))
            # SIGTERM as an orchestrator sends it, to the launcher; SIGINT as a terminal does, to the whole group.
            # The launcher passes a signal on to its front-ends as SIGTERM, which can reach one before the group's
            # SIGINT does: that SIGINT is still the first Ctrl-C, not a second one that forces the exit.
            if how == "sigint_after_launchers_sigterm":
                os.kill(children(service.process.pid)["llm-api-0"], signal.SIGTERM)
                wait_draining(service.url)
            if how == "sigterm":
                service.process.send_signal(signal.SIGTERM)
            else:
                os.killpg(service.process.pid, signal.SIGINT)
            rest = [json.loads(e) for e in events]
        assert first["index"] == 0 and rest[-1]["details"]["generated_tokens"] == 150  # finished, not cut
        assert service.process.wait(timeout=30) == 0


def test_a_second_ctrl_c_stops_at_once():
    with service_process() as service:
        with httpx.stream("POST", f"{service.url}/generate_stream", json=LONG, timeout=60) as r:
            events = sse_events(r)
            next(events)
            os.killpg(service.process.pid, signal.SIGINT)
            wait_draining(service.url)  # two signals that arrive before the handler runs are one
            os.killpg(service.process.pid, signal.SIGINT)
            with pytest.raises(httpx.RemoteProtocolError):  # cut: no drain
                list(events)
        assert service.process.wait(timeout=10) == 0


def test_requests_outlasting_the_drain_end_with_an_error_of_ours_not_a_cut():
    with service_process(drain_seconds=1) as service:
        results = {}

        def whole():
            r = httpx.post(f"{service.url}/generate", json=LONG, timeout=60)
            results["whole"] = (r.status_code, r.headers.get("content-type"), r.text)

        thread = threading.Thread(target=whole)
        with httpx.stream("POST", f"{service.url}/generate_stream", json=LONG, timeout=60) as r:
            events = sse_events(r)
            first = json.loads(next(events))
            thread.start()
            time.sleep(0.5)
            service.process.send_signal(signal.SIGTERM)
            rest = [json.loads(e) for e in events]
        thread.join(30)
        assert first["index"] == 0 and rest[-1]["error_type"] == "generation" and "shut down" in rest[-1]["error"]
        status, content_type, text = results["whole"]
        assert status == 500 and content_type == "application/json" and "shut down" in json.loads(text)["error"]
        assert service.process.wait(timeout=30) == 0


def test_while_draining_new_connections_get_429_and_a_503_health_then_the_listener_closes():
    # Two front-ends share the port: the idle one stops at once, the busy one keeps answering for both.
    with service_process(api_server_count=2, drain_seconds=5) as service:
        with httpx.stream("POST", f"{service.url}/generate_stream", json=LONG, timeout=60) as r:
            events = sse_events(r)
            first = json.loads(next(events))
            service.process.send_signal(signal.SIGTERM)
            wait_draining(service.url)  # the signal reached the front-ends
            # a fresh client each: a new connection, as a load balancer's probe or a new client makes
            with httpx.Client(timeout=10) as client:
                health = client.get(f"{service.url}/health")
            with httpx.Client(timeout=10) as client:
                refused = client.post(f"{service.url}/generate", json={"inputs": "a"})
            rest = [json.loads(e) for e in events]
        assert health.status_code == 503 and health.json() == {"status": "unavailable"}
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        assert refused.json()["error_type"] == "overloaded"
        last = rest[-1]
        assert first["index"] == 0 and ("details" in last or "shut down" in last.get("error", "")), last
        assert service.process.wait(timeout=30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{service.url}/health")


def test_a_signal_with_nothing_in_flight_stops_the_service_at_once():
    with service_process() as service:  # the default drain: 30 s
        start = time.monotonic()
        service.process.send_signal(signal.SIGTERM)
        assert service.process.wait(timeout=30) == 0
        assert time.monotonic() - start < 5


def test_an_engine_core_that_cannot_load_its_model_stops_the_service_at_once(tmp_path):
    """A checkpoint that does not load: the launcher exits 1 within seconds, front-ends and all (it took 65 s while
    front-ends waiting for the core sat out the stop timeout)."""
    model = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL_DIR, model)
    (model / "model.safetensors").write_bytes(b"not a checkpoint")
    argv, env, _ = launch_command(tmp_path, model=str(model))
    start = time.monotonic()
    result = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "llm-engine-core exited" in result.stderr + result.stdout
    assert time.monotonic() - start < 30, result.stderr[-2000:]


def test_a_front_end_waiting_for_its_engine_core_stops_at_once_on_a_signal(tmp_path):
    """A front-end still starting (waiting for an engine core that will not answer: it died loading, say) leaves on
    the launcher's SIGTERM at once, where it used to sit out the launcher's whole stop timeout before a SIGKILL."""
    start_front_end = ("import sys; from service.config import Settings; from service.launcher import bind, "
                       "frontend_main; frontend_main(Settings(device='cpu', log_level='info'), [sys.argv[1]], "
                       "bind('127.0.0.1', 0), 0)")
    front_end = subprocess.Popen([sys.executable, "-c", start_front_end, f"ipc://{tmp_path / 'nobody.sock'}"],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in front_end.stdout:  # until uvicorn runs the app's startup (its signal handlers are in place)
            if "Waiting for application startup" in line:
                break
        time.sleep(0.5)
        assert front_end.poll() is None  # still waiting for the core
        start = time.monotonic()
        front_end.send_signal(signal.SIGTERM)
        front_end.wait(timeout=30)
        assert time.monotonic() - start < 5
    finally:
        front_end.kill()
        front_end.communicate()
