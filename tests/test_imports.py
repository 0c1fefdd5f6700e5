"""The house's import rules: no import circles, no role reaching into another role's
internals, every module importable on its own, and a serving runtime that does not load
the offline modelling package (or numpy) to schedule."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from import_graph import ImportGraph, build_graph

#: the process roles (DESIGN.md): each one's logic is a package whose `__init__` is its
#: public API; other packages import only the names it exports
ROLES = ("frontend", "scheduler", "worker", "detokenizer", "api")


@pytest.fixture(scope="module")
def graph() -> ImportGraph:
    return build_graph()


def test_the_graph_sees_the_whole_package(graph: ImportGraph) -> None:
    for name in (
        "sarazmq.scheduler.scheduler",
        "sarazmq.kernels.backend",
        "sarazmq.procs.launcher",
        "sarazmq.api.app",
        "sarazmq.perf.gpu",
    ):
        assert name in graph.modules
    # a known edge each way: eager, lazy (inside a function)
    eager = graph.targets("sarazmq.procs.scheduler", lazy=False)
    assert "sarazmq.scheduler" in eager
    assert "sarazmq.procs.launcher" in graph.targets("sarazmq.cli.serve")
    assert "sarazmq.procs.launcher" not in graph.targets("sarazmq.cli.serve", lazy=False)


def test_no_import_circles(graph: ImportGraph) -> None:
    """Not even through imports inside functions: a circle there is a design circle the
    function-level import only hides."""
    assert graph.cycles(lazy=True) == []


def test_the_cycle_finder_finds_a_circle() -> None:
    from import_graph import ImportEdge

    g = ImportGraph(
        modules={"sarazmq.a": None, "sarazmq.b": None, "sarazmq.c": None},  # type: ignore[dict-item]
        edges=[
            ImportEdge("sarazmq.a", "sarazmq.b", (), 1, False),
            ImportEdge("sarazmq.b", "sarazmq.a", (), 1, True),
            ImportEdge("sarazmq.b", "sarazmq.c", (), 1, False),
        ],
    )
    assert g.cycles(lazy=True) == [["sarazmq.a", "sarazmq.b"]]
    assert g.cycles(lazy=False) == []


def role_violations(graph: ImportGraph, public: dict[str, set[str]]) -> list[str]:
    """Imports of a role's modules, or of names its `__all__` lacks, from outside it."""
    bad = []
    for e in graph.edges:
        parts = e.target.split(".")
        if len(parts) < 2 or parts[0] != "sarazmq" or parts[1] not in public:
            continue
        role = parts[1]
        if e.importer.startswith(f"sarazmq.{role}.") or e.importer == f"sarazmq.{role}":
            continue
        if len(parts) > 2:
            bad.append(f"{e.importer}:{e.line} imports {e.target} (use sarazmq.{role})")
        for name in e.names:
            if name not in public[role]:
                bad.append(f"{e.importer}:{e.line} imports {name}, not in sarazmq.{role}.__all__")
    return bad


def test_no_module_imports_another_roles_internals(graph: ImportGraph) -> None:
    """Outside a role's package, its names come from the package (its public API, listed
    in its `__all__`), never from its modules."""
    import importlib

    public = {role: set(importlib.import_module(f"sarazmq.{role}").__all__) for role in ROLES}
    assert role_violations(graph, public) == []
    # the rule itself: a module path and an unlisted name are both caught
    from import_graph import ImportEdge

    probe = ImportGraph(
        modules=graph.modules,
        edges=[
            ImportEdge("sarazmq.sim.run", "sarazmq.scheduler.request", ("Request",), 7, False),
            ImportEdge("sarazmq.sim.run", "sarazmq.scheduler", ("Secret",), 8, True),
            ImportEdge("sarazmq.scheduler.scheduler", "sarazmq.scheduler.request", (), 9, False),
        ],
    )
    assert role_violations(probe, public) == [
        "sarazmq.sim.run:7 imports sarazmq.scheduler.request (use sarazmq.scheduler)",
        "sarazmq.sim.run:8 imports Secret, not in sarazmq.scheduler.__all__",
    ]


def test_every_module_imports_alone(graph: ImportGraph) -> None:
    """Each module imported first, in a process where no other sarazmq module has been
    imported yet (an order-dependent circle fails here). Entry points that run on import
    (`__main__`) are left out."""
    modules = sorted(m for m in graph.modules if not m.endswith("__main__"))
    code = textwrap.dedent(
        """
        import importlib, sys, traceback
        failed = []
        for name in sys.argv[1:]:
            for loaded in [m for m in sys.modules if m == "sarazmq" or m.startswith("sarazmq.")]:
                del sys.modules[loaded]
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name + ": " + traceback.format_exc(limit=3))
        print("\\n".join(failed))
        sys.exit(1 if failed else 0)
        """
    )
    # two processes, each on every other module: the re-imports are single-threaded
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *modules[i::2]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, out + err
    finally:
        for proc in procs:
            proc.kill()


def test_the_scheduler_loads_no_modelling_package() -> None:
    """`import sarazmq.scheduler` (what the scheduler process runs on) loads neither the
    offline modelling package (`sarazmq.perf`: GPU tables, rooflines) nor numpy; its
    numpy names (the fit, the online model) load on first use."""
    code = textwrap.dedent(
        """
        import sys
        import sarazmq.scheduler
        import sarazmq.procs.scheduler
        loaded = sorted(m for m in sys.modules
                        if m.startswith("sarazmq.perf") or m.split(".")[0] in ("numpy", "torch"))
        print("loaded=" + ",".join(loaded))
        from sarazmq.scheduler import OnlineLatencyModel, fit_latency_model
        print("numpy_after=" + str("numpy" in sys.modules))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["loaded=", "numpy_after=True"]


def test_the_checkout_root_never_shadows_a_top_level_package() -> None:
    # the checkout's kernels/ is sarazmq.kernels; as a top-level `kernels` it would shadow
    # Hugging Face's package of that name, which transformers imports where it is
    # installed. Neither this process nor a launcher's child (`python -m`, started from the
    # checkout) may have the checkout root on sys.path.
    from pathlib import Path

    from sarazmq.procs.spawn import child_environment

    root = Path(__file__).resolve().parent.parent
    assert (root / "kernels" / "__init__.py").is_file()
    assert all(p not in ("", ".") and Path(p).resolve() != root for p in sys.path)
    env = child_environment(threads=1)
    assert env["PYTHONSAFEPATH"] == "1" and env["OMP_NUM_THREADS"] == "1"
    # `python -m site` lists sys.path one quoted entry a line
    out = subprocess.run(
        [sys.executable, "-m", "site"], cwd=root, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0 and "sys.path" in out.stdout, out.stderr
    assert f"'{root}'," not in out.stdout, out.stdout
    # the control: without it, `python -m` does put the checkout on sys.path
    plain = {k: v for k, v in env.items() if k != "PYTHONSAFEPATH"}
    out = subprocess.run(
        [sys.executable, "-m", "site"], cwd=root, env=plain, capture_output=True, text=True
    )
    assert f"'{root}'," in out.stdout, out.stdout


def test_python_m_sarazmq_cli_from_the_checkout_drops_it_from_sys_path() -> None:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    # as `python -m sarazmq.cli --help` run in the checkout: sys.path[0] is its root ("")
    code = textwrap.dedent(
        """
        import importlib.util, runpy, sys
        sys.argv = ["sarazmq", "--help"]
        try:
            runpy.run_module("sarazmq.cli", run_name="__main__")
        except SystemExit:
            pass
        spec = importlib.util.find_spec("kernels")
        print("KERNELS", spec.origin if spec else None)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("KERNELS") and str(root / "kernels") not in line, out.stdout


def test_the_launcher_resolves_a_deployment_without_torch() -> None:
    """`sarazmq serve` resolves the config (model architecture, device, dtype, KV pool,
    GGUF matmuls) before it spawns anything: with torch (seconds to import) left to the
    workers. On a machine without GPU device nodes that takes neither torch nor
    transformers; the result is the one this process (torch loaded) resolves."""
    code = textwrap.dedent(
        """
        import sys
        import sarazmq.procs.launcher
        from sarazmq.config import CacheConfig, EngineConfig
        from sarazmq.resolve import gpu_driver_present, resolve_engine_config
        config, model = resolve_engine_config(EngineConfig(cache=CacheConfig(num_blocks=100)))
        print(config.device, config.dtype, config.gguf_matmul, model.num_layers)
        print("gpu_nodes=" + str(gpu_driver_present()))
        print("loaded=" + ",".join(m for m in ("torch", "transformers") if m in sys.modules))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    resolved, gpu_nodes, loaded = proc.stdout.strip().splitlines()
    from sarazmq.config import CacheConfig, EngineConfig
    from sarazmq.resolve import resolve_engine_config

    config, model = resolve_engine_config(EngineConfig(cache=CacheConfig(num_blocks=100)))
    assert resolved == f"{config.device} {config.dtype} {config.gguf_matmul} {model.num_layers}"
    if gpu_nodes == "gpu_nodes=False":
        assert loaded == "loaded=", loaded
    else:  # a GPU machine: torch answers whether CUDA works; still no transformers
        assert "transformers" not in loaded
