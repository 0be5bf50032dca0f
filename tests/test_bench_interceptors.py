"""perf/bench_interceptors.py at its smallest setting prints one JSON line of the documented shape."""

import json

from fvgraph.caching.methods import METHODS
from fvgraph.perf import bench_interceptors


def test_the_bench_prints_one_line_per_run_with_every_method(capsys):
    bench_interceptors.main(["--card", "tiny-wan", "--shape", "32x32x1", "--steps", "4", "-O", "0", "--repeats", "1",
                             "--baselines", "eager", "--setting", "magcache:threshold=0.5"])  # fmt: skip
    [line] = [json.loads(text) for text in capsys.readouterr().out.splitlines() if text.startswith("{")]
    assert line["bench"] == "interceptors" and line["method_version"] >= 1 and line["steps"] == 4
    assert set(line["uncached_wall_ms"]) == {"fvgraph_none", "diffusers_eager_none"} and not line["errors"]
    assert set(line["methods"]) == set(METHODS)
    magcache = line["methods"]["magcache"]
    assert magcache["setting"]["threshold"] == 0.5
    assert set(magcache["fvgraph"]) == {"wall_ms", "speedup", "flops_ratio", "computed", "reused"}
    assert set(magcache["fvgraph"]["speedup"]) == {"repeats", "min", "median", "max"}
    assert 0 < magcache["fvgraph"]["flops_ratio"] <= 1 and magcache["fvgraph"]["computed"] > 0
    assert len(magcache["quality"]["rel_l2_per_step"]) == 4
    assert set(magcache["diffusers_eager"]) == {"wall_ms", "speedup"}
    assert set(magcache["goals"]) == {"speedup_at_least_diffusers_eager"}
    for method in ("fbcache", "taylorseer"):  # diffusers has these too: its hook runs beside
        assert set(line["methods"][method]["diffusers_eager"]) == {"wall_ms", "speedup"}
