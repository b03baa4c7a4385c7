"""The test toolkit: one of each tool the suites share, so copies cannot drift.

- `canaries`: the prompt text and secret the tests send, which must never reach a log.
- `collected_log`: every log line of a test run (in-process and subprocess tethers) in one file.
- `leak_check`: `python -m tests.support.leak_check` fails if that file holds a canary.
- `metrics`: read one Prometheus sample through prometheus-client's public API.
- `net`: `free_port()`.
- `processes`: start the real `tether` (and the fake engine) as subprocesses.
- `raw_http`: an HTTP/1.1 client on a bare socket, for tests that decide when a client leaves.
- `smg`: SGLang's model gateway as the real router in front of tether or an engine.
- `waiting`: `poll_until(condition, timeout)` and `within(awaitable, timeout, what)`.
"""
