"""The cluster file (controlplane/cluster.py): errors name the field; a valid file round-trips."""

from __future__ import annotations

import textwrap

import pytest

from controlplane.cluster import (
    ClusterFileError,
    dump_cluster_file,
    load_cluster_file,
    parse_cluster_file,
)

VALID = textwrap.dedent("""\
    clusters:
      - name: prod
        poll_interval_s: 0.5
        timeout_s: 1.5
        window_s: 30
        slos: {ttft_p99: 2.0, ttlt_p99: 60.0}
        replicas:
          - name: a100-0
            api_url: http://127.0.0.1:8000/
            control_url: http://127.0.0.1:8001
            token_env: TAILPILOT_TOKEN
          - name: a100-1
            api_url: https://gpu1.example:8000
            control_url: https://gpu1.example:8001
      - name: staging
        replicas:
          - name: s0
            api_url: http://10.0.0.5:8000
            control_url: http://10.0.0.5:8765
""")


def _with(text: str, old: str, new: str) -> str:
    assert old in text
    return text.replace(old, new, 1)


def test_valid_file_round_trips(tmp_path):
    cf = parse_cluster_file(VALID)
    prod = cf.cluster("prod")
    assert [r.name for r in prod.replicas] == ["a100-0", "a100-1"]
    assert prod.poll_interval_s == 0.5 and prod.timeout_s == 1.5 and prod.window_s == 30
    assert prod.slos == {"ttft_p99": 2.0, "ttlt_p99": 60.0}
    a = prod.replica("a100-0")
    assert a.api_url == "http://127.0.0.1:8000"  # trailing slash dropped
    assert a.metrics_url == "http://127.0.0.1:8000/metrics"
    assert a.token_env == "TAILPILOT_TOKEN"
    staging = cf.cluster("staging")
    assert staging.poll_interval_s == 1.0 and staging.timeout_s == 2.0 and staging.window_s == 60.0

    path = tmp_path / "clusters.yaml"
    path.write_text(dump_cluster_file(cf))
    again = load_cluster_file(path)
    assert again == cf
    assert dump_cluster_file(again) == dump_cluster_file(cf)


def test_token_comes_from_the_environment(monkeypatch):
    a = parse_cluster_file(VALID).cluster("prod").replica("a100-0")
    monkeypatch.delenv("TAILPILOT_TOKEN", raising=False)
    assert a.token() is None
    monkeypatch.setenv("TAILPILOT_TOKEN", "s3cret")
    assert a.token() == "s3cret"
    assert parse_cluster_file(VALID).cluster("prod").replica("a100-1").token() is None


def test_unknown_field_is_named():
    with pytest.raises(ClusterFileError) as err:
        parse_cluster_file(
            _with(
                VALID,
                "        token_env: TAILPILOT_TOKEN\n",
                "        token_env: TAILPILOT_TOKEN\n        colour: red\n",
            ),
            "c.yaml",
        )
    assert "c.yaml" in str(err.value)
    assert "clusters[0].replicas[0].colour" in str(err.value)

    with pytest.raises(ClusterFileError, match=r"clusters\[1\]\.pol_interval_s"):
        parse_cluster_file(
            _with(VALID, "  - name: staging\n", "  - name: staging\n    pol_interval_s: 1\n")
        )

    with pytest.raises(ClusterFileError, match=r"(?s)^(?!.*clusters\[).*extra"):
        parse_cluster_file(VALID + "extra: 1\n")


@pytest.mark.parametrize(
    "url, words",
    [
        ("ftp://127.0.0.1:8001", "http(s) URL"),
        ("127.0.0.1:8001", "http(s) URL"),
        ("http://:8001", "http(s) URL"),
        ("http://127.0.0.1:99999", "invalid port"),
        ("http://127.0.0.1:8001?x=1", "no query"),
    ],
)
def test_bad_url_is_named(url, words):
    with pytest.raises(ClusterFileError) as err:
        parse_cluster_file(
            _with(VALID, "control_url: http://127.0.0.1:8001", f"control_url: {url!r}")
        )
    message = str(err.value)
    assert "clusters[0].replicas[0].control_url" in message
    assert words in message


def test_duplicate_names_are_named():
    dup_replica = _with(VALID, "name: a100-1", "name: a100-0")
    with pytest.raises(ClusterFileError) as err:
        parse_cluster_file(dup_replica)
    assert "clusters[0]" in str(err.value) and "'a100-0' appears twice" in str(err.value)

    dup_cluster = _with(VALID, "name: staging", "name: prod")
    with pytest.raises(ClusterFileError, match="cluster name 'prod' appears twice"):
        parse_cluster_file(dup_cluster)


def test_other_errors_name_the_field(tmp_path):
    with pytest.raises(ClusterFileError, match=r"clusters\[0\]\.slos: .*unknown metric 'ttft_p42'"):
        parse_cluster_file(_with(VALID, "ttft_p99: 2.0", "ttft_p42: 2.0"))
    with pytest.raises(ClusterFileError, match=r"clusters\[0\]\.timeout_s"):
        parse_cluster_file(_with(VALID, "timeout_s: 1.5", "timeout_s: -1"))
    with pytest.raises(ClusterFileError, match=r"clusters\[1\]\.replicas"):
        parse_cluster_file(
            VALID.split("  - name: staging")[0] + "  - name: staging\n    replicas: []\n"
        )
    with pytest.raises(ClusterFileError, match=r"not valid YAML"):
        parse_cluster_file("clusters: [\n")
    with pytest.raises(ClusterFileError, match="expected a mapping"):
        parse_cluster_file("- 1\n- 2\n")
    with pytest.raises(ClusterFileError, match="cannot read"):
        load_cluster_file(tmp_path / "missing.yaml")


def test_a_file_that_is_not_utf8_is_named_with_the_byte_offset(tmp_path):
    data = VALID.replace("name: staging", "name: stäging").encode("latin-1")
    offset = data.index(b"\xe4")
    path = tmp_path / "clusters.yaml"
    path.write_bytes(data)
    with pytest.raises(
        ClusterFileError, match=f"^{path}: not UTF-8 text \\(byte 0xe4 at offset {offset}\\)$"
    ):
        load_cluster_file(path)
    with pytest.raises(
        ClusterFileError, match=f"^<cluster file>: not UTF-8 text .* offset {offset}"
    ):
        parse_cluster_file(data)
    assert parse_cluster_file(VALID.encode()) == parse_cluster_file(VALID)  # UTF-8 bytes are fine


@pytest.mark.parametrize("old, new, key, line, first", [
    ("clusters:\n", "clusters: []\nclusters:\n", "clusters", 2, 1),
    ("    timeout_s: 1.5\n", "    timeout_s: 1.5\n    timeout_s: 3\n", "timeout_s", 5, 4),
    ("        control_url: http://127.0.0.1:8001\n",
     "        control_url: http://127.0.0.1:8001\n        api_url: http://127.0.0.1:9\n",
     "api_url", 11, 9),
])  # fmt: skip
def test_a_key_written_twice_is_named_with_its_lines(old, new, key, line, first):
    """PyYAML's safe_load silently keeps the last of two equal keys; the second may be a typo'd
    copy."""
    with pytest.raises(
        ClusterFileError,
        match=f"^<cluster file>:{line}: not valid YAML: "
        f"duplicate key '{key}' \\(first on line {first}\\)$",
    ):
        parse_cluster_file(_with(VALID, old, new))


def test_a_merged_key_may_be_overridden():
    text = textwrap.dedent("""\
        clusters:
          - &prod
            name: prod
            timeout_s: 1.5
            replicas: [{name: r0, api_url: "http://h:1", control_url: "http://h:2"}]
          - <<: *prod
            name: staging
            timeout_s: 3
    """)
    staging = parse_cluster_file(text).cluster("staging")
    assert staging.timeout_s == 3 and [r.name for r in staging.replicas] == ["r0"]


def test_lookup_errors_list_the_names():
    cf = parse_cluster_file(VALID)
    with pytest.raises(KeyError, match="name one"):
        cf.cluster()
    with pytest.raises(KeyError, match="prod, staging"):
        cf.cluster("nope")
    with pytest.raises(KeyError, match="a100-0, a100-1"):
        cf.cluster("prod").replica("b200-9")
    assert parse_cluster_file(VALID.split("  - name: staging")[0]).cluster().name == "prod"
