"""benchmarks/serve_bench.py and benchmarks/peers.py without a model or a network: the ratio
table, the PNG plot, the flags, and peers that are missing or fail being skipped."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import peers
import serve_bench as sb
from peers import PeerError, PeerSpec

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def level(mode: str, c: int, tokens: int, wall: float, ttft: float, itl: float) -> sb.LevelResult:
    """A result of `c` samples sharing `tokens` in `wall` seconds."""
    samples = [sb.Sample(ttft=ttft + i * 0.01, itl=[itl] * 3, tokens=tokens // c) for i in range(c)]
    return sb.LevelResult(mode, c, c, wall, samples)


def synthetic() -> sb.Results:
    """nbserve (engine + HTTP) and two peers at levels 1 and 4; nbserve HTTP twice llama_cpp."""
    return {
        sb.NBSERVE_ENGINE: {1: level("engine", 1, 64, 3.0, 0.10, 0.05),
                            4: level("engine", 4, 256, 5.0, 0.40, 0.08)},
        sb.NBSERVE_HTTP: {1: level("http", 1, 64, 4.0, 0.12, 0.06),
                          4: level("http", 4, 256, 5.0, 0.45, 0.09)},
        "llama_cpp": {1: level("llama_cpp", 1, 64, 8.0, 0.20, 0.02),
                      4: level("llama_cpp", 4, 256, 10.0, 3.00, 0.02)},
        "transformers": {4: level("transformers", 4, 256, 20.0, 1.0, 0.20)},  # level 1 missing
    }


def test_ratio_rows_compare_nbserve_http_with_each_peer() -> None:
    rows = sb.ratio_rows(synthetic())
    got = [(r.concurrency, r.server) for r in rows]
    assert got == [(1, sb.NBSERVE_HTTP), (1, "llama_cpp"),
                   (4, sb.NBSERVE_HTTP), (4, "llama_cpp"), (4, "transformers")]
    by = {(r.concurrency, r.server): r for r in rows}
    assert by[(1, sb.NBSERVE_HTTP)].ratio is None
    assert by[(1, sb.NBSERVE_HTTP)].tok_s == pytest.approx(16.0)
    assert by[(1, "llama_cpp")].ratio == pytest.approx(2.0)
    assert by[(4, "llama_cpp")].ratio == pytest.approx(2.0)
    assert by[(4, "transformers")].ratio == pytest.approx(4.0)
    assert by[(4, "llama_cpp")].ttft_p50 == pytest.approx(3.02)  # pct(): nearest rank, 3.00..3.03
    assert by[(4, "transformers")].itl_p95 == pytest.approx(0.20)


def test_ratio_table_text() -> None:
    text = sb.format_ratios(sb.ratio_rows(synthetic()))
    lines = text.splitlines()
    assert "nbserve/peer" in lines[0] and "TTFT p50" in lines[0] and "ITL p95" in lines[0]
    assert len(lines) == 6
    llama_4 = next(x for x in lines if x.split()[:2] == ["4", "llama_cpp"])
    assert llama_4.split()[2:] == ["25.6", "3020", "20", "2.00x"]


def test_no_ratios_without_nbserve_http() -> None:
    results = synthetic()
    del results[sb.NBSERVE_HTTP]
    assert sb.ratio_rows(results) == []


def test_plot_writes_a_png(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "bench.png"
    assert sb.write_plot(synthetic(), path, "synthetic")
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 5000


def test_plot_without_matplotlib_prints_how_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    path = tmp_path / "bench.png"
    assert sb.write_plot(synthetic(), path) is False
    assert not path.exists()
    assert 'pip install -e ".[bench]"' in capsys.readouterr().out


def test_flags() -> None:
    args = sb.parse_args([])
    assert args.peers == ["nbserve_app", "llama_server", "llama_cpp", "transformers"]
    assert args.concurrency == "1,4,16,64" and args.llama_server_flavour == "native"
    assert args.plot == sb.DEFAULT_PLOT and args.plot.name == "serve_bench.png"
    assert sb.parse_args(["--no-peers"]).peers == []
    assert sb.parse_args(["--peers", "transformers"]).peers == ["transformers"]
    assert sb.parse_args(["--levels", "1,8"]).concurrency == "1,8"
    assert sb.parse_args(["--no-plot"]).plot is None
    assert sb.parse_args(["--plot", "x.png"]).plot == Path("x.png")


def test_split_rounds_unchanged() -> None:
    assert sb.split_rounds(4, 1, 2) == [2, 2]
    assert sb.split_rounds(5, 1, 2) == [3, 2]
    assert sb.split_rounds(16, 16, 2) == [16]
    assert sb.split_rounds(4, 32, 2) == [4]


def test_missing_command_is_skipped(tmp_path: Path) -> None:
    spec = PeerSpec("ghost", [str(tmp_path / "no-such-server"), "--port", "{port}"])
    with pytest.raises(PeerError, match="cannot run"):
        peers.start_peer(spec, 5, tmp_path)


def test_missing_module_is_skipped(tmp_path: Path) -> None:
    spec = PeerSpec("ghost", [sys.executable, "-c", "pass"], requires="no_such_module_nbserve",
                    install_hint="pip install ghost")
    with pytest.raises(PeerError, match=r"no_such_module_nbserve is not installed \(pip"):
        peers.start_peer(spec, 5, tmp_path)


def test_peer_that_exits_is_skipped_with_its_log(tmp_path: Path) -> None:
    code = "import sys; print('boom: no model'); sys.exit(3)"
    spec = PeerSpec("quitter", [sys.executable, "-c", code])
    with pytest.raises(PeerError, match=r"exited with code 3 .*boom: no model"):
        peers.start_peer(spec, 20, tmp_path)


def test_peer_ready_then_stopped(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "v1").mkdir(parents=True)
    (site / "v1" / "models").write_text('{"data": [{"id": "m"}]}')
    spec = PeerSpec("static", [sys.executable, "-m", "http.server", "{port}", "--bind",
                               "127.0.0.1", "--directory", str(site)])
    peer = peers.start_peer(spec, 20, tmp_path)
    try:
        assert peer.base.startswith("http://127.0.0.1:") and peer.proc.poll() is None
    finally:
        peers.stop_peer(peer)
    assert peer.proc.poll() is not None


def test_peer_specs_say_why_a_peer_cannot_run(tmp_path: Path) -> None:
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    specs = peers.peer_specs(["llama_cpp", "transformers", "ghost"], str(hf_dir), tmp_path, 2048,
                             60)
    assert [name for name, _ in specs] == ["llama_cpp", "transformers", "ghost"]
    llama, tf, ghost = (spec for _, spec in specs)
    assert isinstance(llama, PeerError) and ".gguf" in str(llama)
    assert isinstance(tf, PeerSpec) and str(hf_dir) in tf.argv and tf.prepare is None
    assert "--continuous-batching" in tf.argv
    assert isinstance(ghost, PeerError) and "unknown peer" in str(ghost)


def test_llama_server_runs_as_its_users_run_it(tmp_path: Path, monkeypatch) -> None:
    """llama.cpp's own server on the .gguf: 16 slots over one 32k context, the file's own chat
    template; unbuilt, it is skipped with the command that builds it."""
    import llama_server

    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv("NBSERVE_BENCH_CACHE", str(tmp_path / "cache"))
    ((_, missing),) = peers.peer_specs(["llama_server"], str(gguf), tmp_path, 2048, 60)
    assert isinstance(missing, PeerError) and "llama_server.py --build" in str(missing)
    binary = llama_server.build_dir() / llama_server.BINARY
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    (_, spec), (_, wide) = peers.peer_specs(["llama_server"], str(gguf), tmp_path, 2048, 60)
    assert isinstance(spec, PeerSpec) and spec.argv[0] == str(binary)
    argv = " ".join(spec.argv)
    assert f"-m {gguf}" in argv and "-np 16 -c 32768" in argv and "--jinja" in argv
    assert spec.levels == (1, 16)  # up to 16 streams; past that 64 slots over 64k tokens
    assert isinstance(wide, PeerSpec) and "-np 64 -c 65536" in " ".join(wide.argv)
    assert wide.levels[0] == 17
    assert spec.warm == wide.warm == (gguf,)


def test_every_peer_starts_with_its_model_file_in_the_page_cache(tmp_path: Path,
                                                                 monkeypatch) -> None:
    """The model file a peer serves is read through once before its start clock runs, so that
    no peer's start to ready pays for the disk while the next one finds the file cached."""
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" * 1000)
    ((_, app),) = peers.peer_specs(["nbserve_app"], str(gguf), tmp_path, 2048, 60)
    ((_, alias),) = peers.peer_specs(["nbserve_app"], "smollm2", tmp_path, 2048, 60)
    assert isinstance(app, PeerSpec) and app.warm == (gguf,)
    assert isinstance(alias, PeerSpec) and alias.warm == ()
    peers.read_through(gguf)  # the real one reads to the end
    events: list[str] = []
    monkeypatch.setattr(peers, "read_through", lambda path: events.append(f"read {path.name}"))
    clock = peers.time.perf_counter
    monkeypatch.setattr(peers.time, "perf_counter", lambda: events.append("clock") or clock())
    site = tmp_path / "site"
    (site / "v1").mkdir(parents=True)
    (site / "v1" / "models").write_text('{"data": [{"id": "m"}]}')
    spec = PeerSpec("static", [sys.executable, "-m", "http.server", "{port}", "--bind",
                               "127.0.0.1", "--directory", str(site)], warm=(gguf,))
    peer = peers.start_peer(spec, 20, tmp_path)
    peers.stop_peer(peer)
    assert events[:2] == ["read m.gguf", "clock"]


def test_nbserve_runs_as_python_app_py_beside_the_peers(tmp_path: Path) -> None:
    ((name, spec),) = peers.peer_specs(["nbserve_app"], "smollm2", tmp_path, 2048, 60)
    assert name == "nbserve_app" and isinstance(spec, PeerSpec)
    assert spec.argv[0] == sys.executable and spec.argv[1].endswith("app.py")
    assert Path(spec.argv[1]).is_file() and "{port}" in spec.argv


def test_ratios_take_python_app_py_as_the_reference_with_memory() -> None:
    results = synthetic()
    results[sb.NBSERVE_APP] = {1: level("app", 1, 64, 2.0, 0.1, 0.05)}
    results[sb.NBSERVE_APP][1].rss_mib = 600.0
    results["llama_cpp"][1].rss_mib = 900.0
    rows = sb.ratio_rows(results)
    assert [(r.concurrency, r.server) for r in rows] == [(1, sb.NBSERVE_APP), (1, "llama_cpp")]
    peer = rows[1]
    assert peer.ratio == pytest.approx(4.0) and peer.rss_ratio == pytest.approx(600 / 900)
    assert sb.format_ratios(rows).splitlines()[2].split()[-2:] == ["900", "0.67x"]


def test_memory_watch_reads_a_process_peak_and_none_once_it_is_gone() -> None:
    import os
    import subprocess

    with peers.RssPeak(os.getpid(), interval=0.01) as watch:
        grown = bytearray(64 << 20)  # +64 MiB while watched
        import time

        time.sleep(0.1)
    assert watch.samples > 1 and watch.peak >= len(grown) / (1 << 20)
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    assert peers.rss_mib(int(done.stdout)) is None


def test_a_peer_spec_only_runs_the_levels_it_serves(capsys: pytest.CaptureFixture) -> None:
    wide = PeerSpec("llama_server", ["/no/such/server"], levels=(17, 1 << 30))
    args = sb.parse_args(["--levels", "1,4", "--peer-timeout", "5"])
    assert asyncio.run(sb.measure_peer(wide, args, [1, 4], [2], Path("/tmp"), 7)) == {}
    assert "starting" not in capsys.readouterr().out  # not even started


def test_the_benchmark_names_the_cpu_and_the_kernel_path() -> None:
    line = sb.cpu_line()
    assert line.startswith("cpu: ") and "cores" in line
    assert sb.kernel_line().startswith("nbserve kernels: ")


def test_bench_reports_skipped_peers_and_continues(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    missing = PeerSpec("ghost", [str(tmp_path / "no-such-server")])
    monkeypatch.setattr(peers, "peer_specs",
                        lambda names, *a: [("ghost", missing),
                                           ("x", PeerError("unknown peer 'x'"))])
    args = sb.parse_args(["--peers", "ghost,x", "--levels", "1", "--peer-timeout", "5"])
    results = asyncio.run(sb.measure_peers(args, [1], [2], 7))
    out = capsys.readouterr().out
    assert results == {}
    assert "peer ghost: skipped: cannot run" in out
    assert "peer x: skipped: unknown peer 'x'" in out


def test_a_peer_from_another_interpreter_is_checked_there(tmp_path):
    import sys

    import peers

    assert peers.module_available(sys.executable, "json")
    assert not peers.module_available(sys.executable, "no_such_module_xyz")
    assert not peers.module_available(str(tmp_path / "no-python"), "json")  # cannot run: False
    spec = peers.llama_cpp_spec(tmp_path / "m.gguf", 512, python=str(tmp_path / "no-python"))
    assert spec.argv[0] == str(tmp_path / "no-python") and spec.python == spec.argv[0]
    with pytest.raises(peers.PeerError, match="llama_cpp is not installed"):
        peers.start_peer(spec, timeout=5, log_dir=tmp_path)


def test_a_connection_the_server_dropped_is_retried() -> None:
    """llama-server may drop a kept-alive connection as the next request goes out: the client
    retries it (as the OpenAI SDK does) instead of giving up on the whole peer."""
    import httpx

    calls = []
    sse = (b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
           b'data: {"choices": [], "usage": {"completion_tokens": 1}}\n\ndata: [DONE]\n\n')

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        if len(calls) == 1:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return httpx.Response(200, content=sse, headers={"content-type": "text/event-stream"})

    async def run() -> sb.Sample:
        async with httpx.AsyncClient(base_url="http://peer/v1",
                                     transport=httpx.MockTransport(handler)) as client:
            return await sb.http_one(client, "m", 4, {}, "r")(0)

    sample = asyncio.run(run())
    assert len(calls) == 2 and sample.tokens == 1 and sample.ttft is not None


FAKE_SERVER = r'''
import http.server, json, sys, time
name, port, log = sys.argv[1], int(sys.argv[2]), sys.argv[3]

class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a): pass
    def _send(self, body, kind):
        self.send_response(200)
        self.send_header("content-type", kind)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        self._send(json.dumps({"data": [{"id": name}]}).encode(), "application/json")
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        with open(log, "a") as f:
            f.write(f"{name} {body['max_tokens']}\n")
        time.sleep(0.02)
        chunks = [{"choices": [{"delta": {"content": "x"}}]}] * body["max_tokens"]
        chunks.append({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
        sse = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        self._send(sse.encode(), "text/event-stream")

http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def test_peers_side_by_side_alternate_their_rounds(tmp_path: Path, capsys) -> None:
    """--together: every peer that serves a level is up at once and their rounds alternate
    (drift hits them alike); a peer starts at its first level and stops after its last."""
    script, log = tmp_path / "fake.py", tmp_path / "requests.log"
    script.write_text(FAKE_SERVER)
    specs = [PeerSpec(name, [sys.executable, str(script), name, "{port}", str(log)],
                      levels=levels) for name, levels in (("a", (1, 1 << 30)), ("b", (1, 1)))]
    args = sb.parse_args(["--levels", "1,2", "--requests-per-level", "4", "--rounds", "2",
                          "--max-tokens", "3", "--peer-timeout", "20"])
    results = asyncio.run(sb.measure_peers_together(specs, args, [1, 2], [], tmp_path, 7))
    assert sorted(results["a"]) == [1, 2] and sorted(results["b"]) == [1]
    assert all(r.requests == 4 for r in [*results["a"].values(), *results["b"].values()])
    served = [line.split() for line in log.read_text().splitlines()]
    load = [name for name, tokens in served if tokens == "3"]  # the warm-ups ask for 8
    assert load == ["a", "a", "b", "b", "a", "a", "b", "b", "a", "a", "a", "a"]
    out = capsys.readouterr().out
    assert out.count("peer a: starting") == 1 and out.count("peer b: starting") == 1


def test_the_bandwidth_bound_counts_the_weights_a_step_reads(tiny_llama_dir, tiny_qwen2_dir,
                                                            tmp_path, monkeypatch) -> None:
    """One stream's bound reads every tensor of a tied model (its head is the embedding) and
    all but the token embedding of an untied one; each server's fraction is its 1-stream
    tok/s over the bound, and subprocess servers get their start and memory lines."""
    from gguf_util import hf_dir_to_gguf

    tied = hf_dir_to_gguf(tiny_llama_dir, tmp_path / "tied.gguf", "Q8_0")
    untied = hf_dir_to_gguf(tiny_qwen2_dir, tmp_path / "untied.gguf", "Q8_0")
    from gguf import GGUFReader

    for path, tied_head in ((tied, True), (untied, False)):
        tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
        assert ("output.weight" not in tensors) == tied_head
        read, found = sb.weights_read_per_token(str(path))
        assert found == path
        assert read == sum(tensors.values()) - (0 if tied_head else tensors["token_embd.weight"])
    assert sb.weights_read_per_token(str(tiny_llama_dir)) is None  # GGUF only

    import bandwidth

    monkeypatch.setattr(bandwidth, "read_bandwidth", lambda threads: 1.0)  # 1 GB/s
    args = sb.parse_args(["--model", str(tied), "--bandwidth-threads", "2"])
    results = synthetic()
    text = sb.format_bound(results, args)
    bound = 1e9 / sb.weights_read_per_token(str(tied))[0]
    assert f"-> {bound:.1f} tok/s" in text and "2 threads" in text
    http = results[sb.NBSERVE_HTTP][1].tok_s
    assert f"{http:6.1f} tok/s at 1 stream = {http / bound:.0%} of the bound" in text
    monkeypatch.setitem(sb.STARTUPS, "llama_cpp", [(2.5, 700.0)])
    results["llama_cpp"][4].rss_mib = 900.0
    assert "ready in   2.5 s, idle 700 MiB, peak 900 MiB" in sb.format_startups(results)
