"""What the two real-engine suites (`tests/real_vllm`, `tests/real_sglang`) share; each suite
keeps only what is its engine's own (how it is installed and started, its configurations, how
its evidence reads). The general tools they use (`processes`, `raw_http`, `metrics`,
`blocking_http`, `waiting`, `smg`) are the toolkit's, one level up.

- `suite`: a suite's description (opt-in variable, marker, configurations, how a stack starts)
  and its collection rules: marked, skipped unless enabled, ordered by configuration.
- `fixtures`: the fixtures both suites' conftests take from here, driven by their `suite`.
- `stacks`: an engine with tether in front of it, the pool that keeps one running, the
  engines' setup scripts.
- `tether`: the `tether` console script in front of a real engine, and its admin API.
- `measurements`: the numbers a suite measures, printed at the end of the run.
- `clients`: the real clients, the openai SDK and aiperf.
"""
