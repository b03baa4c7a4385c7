"""The test toolkit: one of each tool the suites share, so copies cannot drift. Test files and
conftests import what they need from here, never from a conftest.

For the in-process suite (tether, its upstreams and the client in the test's event loop):

- `settings`: `make_settings(**overrides)`, settings that never read the environment.
- `upstreams`: serve the fake engine or a test's own app on loopback; the fixtures' types.
- `in_process`: the in-process tether's URLs; `settled`, `drained`, `leave_mid_stream`.
- `chat`: the chat request the tests send (`chat_body`), the IDs of its answer (`sse_ids`).
- `scripted_engine`, `fastapi_engine`, `realtime_engine`: engines for wire-level tests.
- `nginx`: nginx in front of an engine, the reference a test compares tether with.
- `openai_node`: the openai Node SDK (the npm package, run by `node`) as a client.

For every suite:

- `processes`: processes a test starts: the real `tether` and the fake engine (asyncio), and
  the blocking kind the real-engine suites run (own session, log file, pinned core).
- `raw_http`: HTTP/1.1 on a bare socket, for tests that decide when a client leaves:
  `RawClient` (asyncio) and `RawExchange` (blocking).
- `blocking_http`: plain GET and POST (urllib) for code that blocks.
- `metrics`: read metrics through prometheus-client's public API: one sample exactly
  (`metric`, `metric_in_text`), or a scrape of another process (`scrape`, `MetricsSnapshot`).
- `waiting`: `poll_until(condition, timeout)`, `within(awaitable, timeout, what)`, and the
  blocking `wait_until(predicate, timeout, what)`.
- `net`: `free_port()`, `free_ports(count)`.
- `fake_transport`: tether's protocols without sockets: `FakeTransport`, `FakeEngine` (the
  pool's connector), `FakeWriter` (a client writer whose drain the test decides),
  `SteppedClockLoop` (a clock the test moves) and `settle()`.
- `smg`: SGLang's model gateway as the real router in front of tether or an engine.
- `canaries`: the prompt text and secret the tests send, which must never reach a log.
- `collected_log`: every log line of a test run (in-process and subprocess tethers) in one file.
- `leak_check`: `python -m tests.support.leak_check` fails if that file holds a canary.
- `stages`: the stages CI runs the tests in (`--stage`), every test in exactly one, and the
  guard that fails a `socket_free` test that opens a socket or starts a process.

`real_engine/`: what the real-vLLM and real-SGLang suites share (their suite description and
fixtures, stacks, tether in front of a real engine, measurements, real clients).
"""
