"""The template's own code meets the bar it sets for generated projects."""

import ast
import subprocess
from pathlib import Path

import pytest
from conftest import BIN, K8S_VAR, PACKAGE_SOURCES, PROJECT_SOURCES, TEMPLATE, local_k8s

OWN_CODE = [
    "hooks",
    "tests",
    "scripts",
    "benchmarks/loop-overhead",
    "benchmarks/attention",
    "benchmarks/loss",
    "benchmarks/peer",
    "local_extensions.py",
    "new-project",
    "{{cookiecutter.project}}",  # unrendered, under its own ruff.toml: the project's settings
]


def test_own_python_is_ruff_clean():
    for command in (["check"], ["format", "--check"]):
        # No cache: ruff would leave .ruff_cache/ in the template folder, and every render would copy it.
        done = subprocess.run(
            [BIN / "ruff", *command, "--no-cache", *OWN_CODE], cwd=TEMPLATE, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr


def test_every_python_source_of_the_template_parses_before_rendering():
    """Jinja only in strings, docstrings and comments: ruff and an editor read the sources as they are."""
    sources = [*PROJECT_SOURCES.rglob("*.py"), TEMPLATE / "hooks" / "post_gen_project.py"]
    assert len(sources) > 50
    for source in sources:
        ast.parse(source.read_text(), str(source))


def imports_of(module: str, source: Path, modules: set[str]) -> set[str]:
    """The package's own modules that `source` (the module `module`) imports, relatively."""
    package = module.split(".") if source.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            for alias in node.names:
                named = f"{base}.{alias.name}".strip(".")
                found.add(named if named in modules else base)
    return found - {module}


def module_name(source: Path) -> str:
    parts = source.relative_to(PACKAGE_SOURCES).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_package_has_no_import_cycle():
    sources = {module_name(source): source for source in PACKAGE_SOURCES.rglob("*.py")}
    graph = {module: imports_of(module, source, set(sources)) for module, source in sources.items()}
    assert graph["train"] >= {"config.validate", "run.trainer", "core.world"}  # relative imports, in wings too

    finished: set[str] = set()

    def cycle_from(module: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        """Depth first; a module met again on the path closes a cycle."""
        if module in path:
            return path[path.index(module) :] + (module,)
        if module in finished:
            return None
        for imported in sorted(graph[module]):
            if found := cycle_from(imported, (*path, module)):
                return found
        finished.add(module)
        return None

    for module in sorted(graph):
        assert (cycle := cycle_from(module, ())) is None, " -> ".join(cycle)


def test_ci_runs_the_readme_test_command():
    """The README's opening commands name the full tier as what CI runs, and .ci/run runs it,
    with the API server's folder set for the tests that need it."""
    opening = (TEMPLATE / "README.md").read_text().split("\n## ")[0]
    block = opening.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["make demo", "make test-full"] and "(what CI runs)" in block
    ci = (TEMPLATE / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == "make test-full"
    assert "export NO_SKIPS=1" in ci  # a skip fails there
    assert any(line.startswith("export DDP_TEMPLATE_K8S=") for line in ci)


def test_a_skip_fails_where_no_skips_is_set_unless_it_needs_a_gpu(pytester, monkeypatch):
    """tests/no_skips.py, which the conftest loads: in CI, a test that skipped did not run."""
    pytester.makeconftest("from no_skips import pytest_runtest_makereport  # noqa: F401\n")
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture
        def server():
            pytest.skip("no API server")

        def test_needs_a_server(server):
            pass

        @pytest.mark.gpu
        def test_needs_a_gpu():
            pytest.skip("no GPU")
        """
    )
    monkeypatch.delenv("NO_SKIPS", raising=False)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(skipped=2)
    monkeypatch.setenv("NO_SKIPS", "1")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(errors=1, skipped=1)  # a fixture's skip fails the test's setup
    result.stdout.fnmatch_lines(["*skipped where NO_SKIPS is set: *no API server*"])


def test_the_api_server_tests_skip_saying_what_to_set(monkeypatch, tmp_path):
    """A clone without the local API server: the skip names DDP_TEMPLATE_K8S and what it holds."""
    for value, says in [(None, f"{K8S_VAR} is not set"), (str(tmp_path), f"{K8S_VAR}={tmp_path}: no cluster.sh there")]:
        if value is None:
            monkeypatch.delenv(K8S_VAR, raising=False)
        else:
            monkeypatch.setenv(K8S_VAR, value)
        with pytest.raises(pytest.skip.Exception) as skipped:
            local_k8s()
        assert str(skipped.value).startswith(f"{says}; these tests need a local Kubernetes API server: set {K8S_VAR}")
        assert "workspace" not in str(skipped.value)
    (tmp_path / "cluster.sh").write_text("#!/bin/sh\n")
    assert local_k8s() == tmp_path.resolve()
