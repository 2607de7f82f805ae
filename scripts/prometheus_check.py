#!/usr/bin/env python3
"""The Python half of scripts/prometheus-check.sh: checks the Grafana dashboard and the alert rules in
deploy/ against a real Prometheus that scrapes real gateways.

Subcommands (all but `traffic` use the standard library only):

  ports N                  print N TCP ports free on 127.0.0.1
  wait-ready ADMIN...      wait until each gateway's admin listener answers and its peers are up
  wait-prometheus URL PID  wait until Prometheus at URL is ready (while process PID lives)
  wait-targets URL N       wait until Prometheus at URL has N active targets, all `up`
  check URL DASH RULES     query every dashboard expression and every alert rule through URL
  traffic PSOCK DSOCK PNAME DNAME READY
                           (the Python client's environment) move KV between the gateways whose
                           engine sockets are PSOCK and DSOCK, fail some rooms, hold one room
                           live, write the file READY, and wait until killed

`check` fails when a query errors, when a dashboard query returns no series, when a metric an alert
rule reads has no series, or when a rule of RULES is not loaded with health "ok".
"""

from __future__ import annotations

import json
import os
import random
import re
import socket
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

#: What Grafana's built-in variables stand for in the queries sent here.
GRAFANA_BUILTINS = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__interval_ms": "60000",
    "__range": "5m",
    "__range_s": "300",
    "__range_ms": "300000",
}
#: Words of PromQL that look like metric names in an expression.
PROMQL_WORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "offset",
    "bool", "inf", "nan", "atan2",
    # aggregation operators, which may be followed by `by (...)` before their parenthesis
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
}


class CheckFailed(Exception):
    pass


def log(msg: str) -> None:
    print(f"prometheus-check: {msg}", flush=True)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status), r.read().decode()
    except urllib.error.HTTPError as e:
        return int(e.code), e.read().decode(errors="replace")


def api(base: str, path: str, **params: str) -> Any:
    """A Prometheus HTTP API call: its `data`, or CheckFailed with Prometheus' error."""
    url = f"{base}{path}"
    if params:
        url += "?" + urllib.parse.urlencode(params)
    try:
        code, body = http_get(url, timeout=10.0)
    except (OSError, urllib.error.URLError) as e:
        raise CheckFailed(f"GET {url}: {e}") from None
    try:
        doc = json.loads(body)
    except ValueError:
        raise CheckFailed(f"GET {url}: HTTP {code}, not JSON: {body[:300]}") from None
    if doc.get("status") != "success":
        raise CheckFailed(f"{doc.get('errorType', 'error')}: {doc.get('error', body[:300])}")
    return doc["data"]


def free_ports(n: int) -> list[int]:
    """`n` distinct ports free on 127.0.0.1 now, picked at random below the kernel's ephemeral range
    so that an outgoing connection cannot take one before its listener binds it."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    ports: list[int] = []
    for _ in range(64 * n):
        if len(ports) == n:
            break
        port = random.randrange(10_000, max(low, 10_001))
        if port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    if len(ports) != n:
        raise CheckFailed(f"found only {len(ports)} of {n} free ports")
    return ports


def wait_ready(admins: list[str], timeout: float) -> None:
    """Each gateway's admin listener answers `/plugins` and lists none of its peers as down."""
    deadline = time.monotonic() + timeout
    for admin in admins:
        last = "no answer"
        while True:
            try:
                code, body = http_get(f"http://{admin}/plugins", timeout=1.0)
                if code == 200 and '"up":false' not in body.replace(" ", ""):
                    break
                last = f"HTTP {code}: {body[:300]}"
            except (OSError, urllib.error.URLError) as e:
                last = str(e)
            if time.monotonic() > deadline:
                raise CheckFailed(f"gateway at {admin} not ready with its peers up within {timeout:.0f} s (GATEWAY_READY_TIMEOUT_S); last: {last}")
            time.sleep(0.1)
        log(f"gateway at {admin} ready, peers up")


def wait_prometheus(base: str, pid: int, timeout: float) -> None:
    """Prometheus answers `/-/ready` (while its process `pid` lives)."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            code, body = http_get(f"{base}/-/ready", timeout=1.0)
            if code == 200:
                log(f"prometheus ready at {base}")
                return
            last = f"HTTP {code}: {body[:200]}"
        except (OSError, urllib.error.URLError) as e:
            last = str(e)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise CheckFailed(f"prometheus (pid {pid}) exited during start-up") from None
        if time.monotonic() > deadline:
            raise CheckFailed(f"prometheus not ready within {timeout:.0f} s (PROMETHEUS_READY_TIMEOUT_S); last: {last}")
        time.sleep(0.25)


def wait_targets(base: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while True:
        try:
            targets = api(base, "/api/v1/targets", state="active")["activeTargets"]
            health = {t["scrapeUrl"]: (t["health"], t.get("lastError", "")) for t in targets}
            if len(targets) == count and all(h == "up" for h, _ in health.values()):
                for url in sorted(health):
                    log(f"target up: {url}")
                return
            last = json.dumps(health)
        except CheckFailed as e:
            last = str(e)
        if time.monotonic() > deadline:
            raise CheckFailed(f"Prometheus did not have {count} targets up within {timeout:.0f} s (TARGETS_UP_TIMEOUT_S); last: {last}")
        time.sleep(0.25)


# ---------------------------------------------------------------------------------------------------
# The dashboard


def dashboard_panels(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every panel, rows' collapsed panels included."""
    out: list[dict[str, Any]] = []
    for p in panels:
        out.append(p)
        out.extend(dashboard_panels(p.get("panels", [])))
    return out


def substitute(expr: str, variables: set[str]) -> str:
    """Grafana's variables replaced the way a query with "All" selected would read: every dashboard
    variable by `.*` (they are used with `=~`), the built-in intervals by fixed durations."""

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name in GRAFANA_BUILTINS:
            return GRAFANA_BUILTINS[name]
        if name in variables:
            return ".*"
        raise CheckFailed(f"unknown variable ${name} in {expr!r}")

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)", one, expr)


def dashboard_queries(path: str) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable of the dashboard; also checks
    its structure (datasource variable, unique panel ids)."""
    with open(path) as f:
        dash = json.load(f)
    templating = dash.get("templating", {}).get("list", [])
    variables = {v["name"] for v in templating}
    ds_vars = [v["name"] for v in templating if v.get("type") == "datasource"]
    if not ds_vars:
        raise CheckFailed(f"{path}: no datasource variable in templating")
    ds_ref = "${%s}" % ds_vars[0]
    if "instance" not in variables:
        raise CheckFailed(f"{path}: no `instance` variable in templating")
    queries: list[tuple[str, str]] = []
    for v in templating:
        if v.get("type") != "query":
            continue
        q = v.get("query")
        q = q.get("query", "") if isinstance(q, dict) else (q or "")
        m = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\)\s*", q)
        if not m:
            raise CheckFailed(f"{path}: variable {v['name']}: expected label_values(selector, label), got {q!r}")
        queries.append((f"variable ${v['name']}", substitute(m.group(1), variables)))
    ids: set[int] = set()
    for p in dashboard_panels(dash.get("panels", [])):
        title = p.get("title", "?")
        pid = p.get("id")
        if not isinstance(pid, int) or pid in ids:
            raise CheckFailed(f"{path}: panel {title!r}: id {pid!r} missing, not a number or used twice")
        ids.add(pid)
        if not isinstance(p.get("gridPos"), dict):
            raise CheckFailed(f"{path}: panel {title!r} has no gridPos")
        if p.get("type") == "row":
            continue
        if (p.get("datasource") or {}).get("uid") != ds_ref:
            raise CheckFailed(f"{path}: panel {title!r} does not use the datasource variable {ds_ref}")
        targets = p.get("targets", [])
        if not targets:
            raise CheckFailed(f"{path}: panel {title!r} has no query")
        for t in targets:
            if (t.get("datasource") or {"uid": ds_ref}).get("uid") != ds_ref:
                raise CheckFailed(f"{path}: panel {title!r} target {t.get('refId')} does not use the datasource variable {ds_ref}")
            expr = t.get("expr", "")
            if not expr.strip():
                raise CheckFailed(f"{path}: panel {title!r} target {t.get('refId')} has no expr")
            queries.append((f"panel {title!r} {t.get('refId', '?')}", substitute(expr, variables)))
    return queries


# ---------------------------------------------------------------------------------------------------
# The rules


def rule_names_in_file(path: str) -> list[str]:
    """The `alert:` and `record:` names of a rules file, read as text (no YAML parser in the standard
    library): each rule names itself on one line."""
    names = []
    with open(path) as f:
        for line in f:
            m = re.match(r"\s*-?\s*(?:alert|record):\s*['\"]?([A-Za-z_:][\w:]*)", line)
            if m:
                names.append(m.group(1))
    return names


def metric_selectors(expr: str) -> list[tuple[str, str]]:
    """(metric name, selector as written) of every vector selector of an expression (roughly: names
    outside strings and label braces that are not functions or keywords)."""
    found: list[tuple[str, str]] = []
    i, n = 0, len(expr)
    while i < n:
        c = expr[i]
        if c in "\"'`":
            j = expr.index(c, i + 1) if c in expr[i + 1 :] else n
            i = j + 1
            continue
        if c == "{":  # a selector without a name, or the labels of one handled below
            i = expr.index("}", i) + 1
            continue
        if c == "[":  # a range or subquery: durations only
            i = expr.index("]", i) + 1
            continue
        m = re.match(r"[A-Za-z_:][\w:]*", expr[i:])
        if m and (i == 0 or not (expr[i - 1].isalnum() or expr[i - 1] in "_.")):
            name = m.group(0)
            j = i + len(name)
            rest = expr[j:].lstrip()
            if rest.startswith("(") or name.lower() in PROMQL_WORDS:
                i = j
                if rest.startswith("(") and name in ("by", "without", "on", "ignoring", "group_left", "group_right"):
                    i = expr.index(")", j) + 1  # a label list, not selectors
                continue
            selector = name
            if rest.startswith("{"):
                k = expr.index("{", j)
                end = expr.index("}", k)
                selector = name + expr[k : end + 1]
                j = end + 1
            found.append((name, selector))
            i = j
            continue
        i += 1 if not m else len(m.group(0))
    return found


def label_names(selector: str) -> list[str]:
    m = re.search(r"\{(.*)\}", selector)
    if not m:
        return []
    return re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", re.sub(r'"(?:[^"\\]|\\.)*"', '""', m.group(1)))


# ---------------------------------------------------------------------------------------------------


def query_until_series(base: str, where: str, expr: str, deadline: float) -> list[dict[str, Any]]:
    """The result of an instant query, asked again (until `deadline`) while it has no series: a rate
    needs two samples of a series in its window. An error fails at once."""
    while True:
        try:
            data = api(base, "/api/v1/query", query=expr)
        except CheckFailed as e:
            raise CheckFailed(f"{where}: query failed: {e}\n    expression: {expr}") from None
        result: list[dict[str, Any]] = data["result"] if isinstance(data["result"], list) else [data["result"]]
        if result or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


def check_selectors(base: str, where: str, expr: str, deadline: float) -> tuple[list[str], list[str]]:
    """Every metric an expression reads has series, with every label its selector names: (problems,
    notes). A selector whose label values match nothing in this run is only noted (e.g. a failure
    reason that did not happen)."""
    problems: list[str] = []
    notes: list[str] = []
    selectors = list(dict.fromkeys(metric_selectors(expr)))
    if not selectors:
        problems.append(f"{where}: no metric found in its expression: {expr}")
    for metric, selector in selectors:
        series = query_until_series(base, where, metric, deadline)
        if not series:
            problems.append(f"{where}: metric {metric} has no series (misspelt, or not exported)\n    expression: {expr}")
            continue
        present = {k for s in series for k in s["metric"]}
        for label in label_names(selector):
            if label not in present:
                problems.append(f"{where}: {metric} has no label {label!r} (it has {sorted(present)})\n    expression: {expr}")
        if selector != metric and not api(base, "/api/v1/query", query=selector)["result"]:
            notes.append(f"{selector} matches nothing in this run")
    return problems, notes


def check(base: str, dashboard: str, rules: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    problems: list[str] = []

    # The dashboard: every query runs and returns at least one series, and every metric it reads exists.
    queries = dashboard_queries(dashboard)
    log(f"dashboard: {len(queries)} queries from {dashboard}")
    nan_only = 0
    for where, expr in queries:
        try:
            result = query_until_series(base, where, expr, deadline)
            found, notes = check_selectors(base, where, expr, deadline)
        except CheckFailed as e:
            problems.append(str(e))
            log(f"  FAIL {where}: query error")
            continue
        if not result and not found:
            found.append(f"{where}: no series (a misspelt metric or label, or a metric this gateway does not export)\n    expression: {expr}")
        if found:
            problems += found
            log(f"  FAIL {where}: " + ("no series" if not result else "bad metric or label"))
            continue
        values = [r["value"][1] for r in result if "value" in r]
        if values and all(v in ("NaN", "+Inf", "-Inf") for v in values):
            nan_only += 1
        log(f"  ok   {where}: {len(result)} series" + (f"; note: {'; '.join(notes)}" if notes else ""))

    # The rules: loaded, evaluated with health ok, each expression runs, and every metric it reads exists.
    expected = rule_names_in_file(rules)
    if not expected:
        problems.append(f"{rules}: no rule found")
    log(f"rules: {len(expected)} rules in {rules}")
    loaded: dict[str, dict[str, Any]] = {}
    while True:
        try:
            groups = api(base, "/api/v1/rules")["groups"]
        except CheckFailed as e:
            raise CheckFailed(f"/api/v1/rules: {e}") from None
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        pending = [n for n in expected if n in loaded and loaded[n].get("health") == "unknown"]
        if not pending or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    for name in expected:
        rule = loaded.get(name)
        if rule is None:
            problems.append(f"rule {name}: not loaded by Prometheus (/api/v1/rules)")
            log(f"  FAIL rule {name}: not loaded")
            continue
        if rule.get("health") != "ok":
            problems.append(f"rule {name}: health {rule.get('health')!r}: {rule.get('lastError', '')}\n    expression: {rule['query']}")
            log(f"  FAIL rule {name}: health {rule.get('health')}")
            continue
        expr = rule["query"]
        try:
            result = api(base, "/api/v1/query", query=expr)["result"]
            found, notes = check_selectors(base, f"rule {name}", expr, deadline)
        except CheckFailed as e:
            problems.append(f"rule {name}: query failed: {e}\n    expression: {expr}")
            log(f"  FAIL rule {name}: query error")
            continue
        if found:
            problems += found
            log(f"  FAIL rule {name}: bad metric or label")
            continue
        state = f"{len(result)} series now" if result else "no series now"
        log(f"  ok   rule {name} ({rule.get('type', '?')}, {state})" + (f"; note: {'; '.join(notes)}" if notes else ""))
    extra = sorted(set(loaded) - set(expected))
    if extra:
        log(f"  (also loaded, not in {rules}: {', '.join(extra)})")

    for a in api(base, "/api/v1/alerts")["alerts"]:
        labels = a.get("labels", {})
        log(f"  active alert: {labels.get('alertname')} {a.get('state')} instance={labels.get('instance', '-')}")

    if problems:
        raise CheckFailed(f"{len(problems)} problem(s):\n  - " + "\n  - ".join(problems))
    log(
        f"PASS: {len(queries)} dashboard queries returned series"
        + (f" ({nan_only} of them NaN only)" if nan_only else "")
        + f"; {len(expected)} alert rules loaded with health ok; every expression ran and every metric it reads exists"
    )


# ---------------------------------------------------------------------------------------------------
# Traffic (needs the `kvgate` Python client)


def traffic(prefill: str, decode: str, prefill_name: str, decode_name: str, ready_file: str) -> None:
    """Rooms through the two gateways in rounds a little over a second apart (so that rates and
    histogram quantiles over the scrapes have samples), two rooms aborted (failures on both sides)
    and one left to its deadline, then one expect left waiting for its sender, live until this
    process is killed."""
    import kvgate  # the Python client (python/), from target/python-venv

    room_bytes = 1 << 20  # 2 parts x 4 chunks of 128 KiB
    parts, chunks = 2, 4
    chunk = room_bytes // (parts * chunks)
    rounds, per_round = 4, 8
    base = time.time_ns() // 1000
    with kvgate.Client(prefill) as p, kvgate.Client(decode) as d, kvgate.SharedPool(
        per_round * room_bytes, memfd=True
    ) as ppool, kvgate.SharedPool(per_round * room_bytes, memfd=True) as dpool:
        p.wait_ready(timeout=10)
        d.wait_ready(timeout=10)
        pregion = p.register_pool(ppool, label="prometheus-check")
        dregion = d.register_pool(dpool, label="prometheus-check")
        ok = 0
        for r in range(rounds):
            handles = []
            for i in range(per_round):
                room = base + r * per_round + i
                off = i * room_bytes
                dparts = [[dregion.slice(off + part * (room_bytes // parts), room_bytes // parts)] for part in range(parts)]
                dh = d.expect(room, prefill_name, dparts)
                sends = [
                    kvgate.Chunk(part, c, [pregion.slice(off + part * (room_bytes // parts) + c * chunk, chunk)], last=c == chunks - 1)
                    for part in range(parts)
                    for c in range(chunks)
                ]
                ph = p.send_chunks(room, sends, peer=decode_name)
                handles += [dh, ph]
            for h in handles:
                outcome = h.terminal(timeout=30)
                if not outcome.succeeded:
                    raise SystemExit(f"traffic: room {h.key} failed: {outcome.reason}")
                h.reusable(timeout=30)
            ok += per_round
            time.sleep(1.2)
        print(f"prometheus-check: traffic: {ok} rooms moved ({ok * room_bytes >> 20} MiB)", flush=True)

        # Failures on both gateways: an expect aborted by the decode engine (its peer's side ends
        # aborted_by_peer) and a send aborted by the prefill engine before any expect.
        fail_a, fail_b, fail_c, parked = base + 10_000, base + 10_001, base + 10_002, base + 10_003
        # And a failure no engine asked for: an expect whose own deadline passes without a sender.
        hc = d.expect(fail_c, prefill_name, [[dregion.slice(2 * chunk, chunk)]], timeout_ms=500)
        ha = d.expect(fail_a, prefill_name, [[dregion.slice(0, chunk)]])
        time.sleep(0.3)
        d.abort(fail_a, why="prometheus-check")
        hb = p.send_chunks(fail_b, [kvgate.Chunk(0, 0, [pregion.slice(0, chunk)])], peer=decode_name)
        time.sleep(0.3)
        p.abort(fail_b, why="prometheus-check")
        reasons = []
        for h in (ha, hb, hc):
            outcome = h.terminal(timeout=30)
            if outcome.succeeded:
                raise SystemExit(f"traffic: room {h.key} succeeded after its abort")
            reasons.append(outcome.reason)
            h.reusable(timeout=30)
        print(f"prometheus-check: traffic: 3 rooms failed ({', '.join(reasons)})", flush=True)

        # One room live while Prometheus is queried: live rooms and room ages have something to show.
        d.expect(parked, prefill_name, [[dregion.slice(chunk, chunk)]])
        print(f"prometheus-check: traffic: room {parked} waiting for its sender (held live)", flush=True)
        with open(ready_file, "w") as f:
            f.write("ready\n")
        time.sleep(600)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    cmd, args = argv[1], argv[2:]
    try:
        if cmd == "ports":
            print(" ".join(str(p) for p in free_ports(int(args[0]))))
        elif cmd == "wait-ready":
            wait_ready(args, float(os.environ.get("GATEWAY_READY_TIMEOUT_S", "20")))
        elif cmd == "wait-prometheus":
            wait_prometheus(args[0], int(args[1]), float(os.environ.get("PROMETHEUS_READY_TIMEOUT_S", "30")))
        elif cmd == "wait-targets":
            wait_targets(args[0], int(args[1]), float(os.environ.get("TARGETS_UP_TIMEOUT_S", "30")))
        elif cmd == "check":
            check(args[0], args[1], args[2], float(os.environ.get("QUERY_TIMEOUT_S", "30")))
        elif cmd == "traffic":
            traffic(args[0], args[1], args[2], args[3], args[4])
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except CheckFailed as e:
        print(f"prometheus-check: FAIL: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
