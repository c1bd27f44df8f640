"""The stack installs and works: real horovodrun jobs with Gloo and MPI, PyTorch and TensorFlow."""

import os
import re
import subprocess

import pytest

import jobs

REPO = os.path.dirname(jobs.HERE)


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize("mpi", [False, True], ids=["gloo", "mpi"])
def test_allreduce_and_allgather(framework, mpi):
    res = jobs.run(2, "smoke.py", framework, mpi=mpi, timeout=180)
    for rank in range(2):
        assert "rank %d of 2 %s: OK" % (rank, framework) in res.output, res


@pytest.mark.slow
def test_check_build_lists_everything():
    out = subprocess.run([jobs.horovodrun(), "--check-build"], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=120).stdout
    for fw in ("TensorFlow", "PyTorch", "MPI", "Gloo"):
        assert re.search(r"\[X\] %s\b" % fw, out), out


def _commands(text):
    return [l.strip() for l in text.splitlines() if l.strip() and not l.strip().startswith("#")]


def test_ci_runs_the_readme_test_command():
    readme = open(os.path.join(REPO, "README.md")).read()
    block = re.search(r"```(?:bash|sh)?\n(.*?)```", readme, re.S).group(1)
    demo_cmd, test_cmd = _commands(block)[:2]
    assert "test" in test_cmd and "demo" in demo_cmd
    assert _commands(open(os.path.join(REPO, ".ci", "run")).read())[-1] == test_cmd



# ------------------------------------------------------------------ commands in the README and docs/

def _pages():
    import glob
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "**", "*.md"), recursive=True))


_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_PYTHON = re.compile(r"^(\S*/)?python3?$")
# what an inline `code span` in prose starts with when it is a command
_INLINE = re.compile(r"(sudo )?(\S*/)?(python3?|horovodrun|bash) |(examples|scripts|docker)/\S+\.(py|sh)( |$)")


def _page_commands():
    """(page, language, text) of every fenced block, and (page, "inline", command) of every command
    given inline in prose (a code span that starts with python, horovodrun, bash or a script)."""
    out = []
    for path in _pages():
        text = open(path).read()
        name = os.path.relpath(path, REPO)
        out += [(name, m.group(1) or "sh", m.group(2)) for m in _FENCE.finditer(text)]
        for m in re.finditer(r"`([^`]+)`", _FENCE.sub("", text)):
            cmd = " ".join(m.group(1).split())
            if _INLINE.match(cmd):
                out.append((name, "inline", cmd))
    return out


def _shell_lines(text):
    import shlex
    for line in text.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split, lexer.commenters = True, "#"
        words = list(lexer)
        if words:
            yield words


def _invocations(words):
    """(program, arguments) of each program the words run: a Python script or module, horovodrun,
    a bash script. A script's arguments end at `--`, at a shell operator or at the next program."""
    stop = lambda w: w == "--" or _PYTHON.match(w) or w in ("horovodrun", "|", "||", "&&", ";", ">", "<")
    i = 0
    while i < len(words):
        w, target = words[i], None
        if _PYTHON.match(w) and i + 2 < len(words) and words[i + 1] == "-m":
            target, i = ("-m", words[i + 2]), i + 3
        elif _PYTHON.match(w) and i + 1 < len(words) and words[i + 1].endswith(".py"):
            target, i = ("py", words[i + 1]), i + 2
        elif i == 0 and re.match(r"examples/\S+\.py$", w):  # prose: `examples/x.py --flag`
            target, i = ("py", w), i + 1
        elif w.endswith("horovodrun"):
            target, i = ("horovodrun", "horovodrun"), i + 1
        elif w == "bash" and i + 1 < len(words) and words[i + 1].endswith(".sh"):
            target, i = ("sh", words[i + 1]), i + 2
        else:
            i += 1
            continue
        j = i
        while j < len(words) and not stop(words[j]):
            j += 1
        yield target, words[i:j]
        i = j


@pytest.mark.slow
def test_commands_in_readme_and_docs_parse_and_run():
    """Every command the README and docs/**/*.md give: shell blocks parse (bash -n), Python blocks
    compile; every script or module they run exists, answers --help, and knows every --option the
    page passes it (horovodrun's too); every bash script they run parses. Placeholders outside the
    repository (train.py) are left alone."""
    import importlib.util
    import sys
    helps, checked = {}, 0
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONPATH=REPO)

    def help_text(argv):
        if argv not in helps:
            out = subprocess.run(list(argv) + ["--help"], cwd=REPO, env=env, capture_output=True,
                                 text=True, timeout=300)
            assert out.returncode == 0, (argv, out.stdout[-2000:], out.stderr[-2000:])
            helps[argv] = out.stdout
        return helps[argv]

    for page, lang, text in _page_commands():
        where = "%s: %s" % (page, text.strip().splitlines()[0] if text.strip() else text)
        if lang == "python":
            compile(text, where, "exec")
            continue
        if lang in ("sh", "bash"):
            out = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True)
            assert out.returncode == 0, (where, out.stderr)
        elif lang != "inline":
            continue
        for words in _shell_lines(text):
            for (kind, target), args in _invocations(words):
                flags = {a.split("=")[0] for a in args if a.startswith("--") and len(a) > 2}
                if kind == "horovodrun":
                    argv = (os.path.join(os.path.dirname(sys.executable), "horovodrun"),)
                elif kind == "-m":
                    if not target.startswith(("examples.", "horovod_twobit")):
                        continue
                    assert importlib.util.find_spec(target) is not None or os.path.exists(
                        os.path.join(REPO, *target.split(".")) + ".py"), (where, target)
                    argv = (sys.executable, "-m", target)
                else:
                    if not target.startswith(("examples/", "scripts/", "docker/", "horovod_twobit/")):
                        continue  # a placeholder such as train.py
                    assert os.path.exists(os.path.join(REPO, target)), (where, target)
                    if kind == "sh":
                        subprocess.run(["bash", "-n", os.path.join(REPO, target)], check=True)
                        continue
                    argv = (sys.executable, target)
                # subcommands (`cluster run --hosts 4`): the words before the first option
                sub = tuple(a for a in args[:next((k for k, a in enumerate(args) if a.startswith("-")),
                                                  len(args))] if re.match(r"^[a-z]+$", a))
                usage = help_text(argv + sub if kind != "horovodrun" else argv)
                for flag in flags:
                    assert re.search(r"(?<![\w-])%s(?![\w-])" % re.escape(flag), usage), (where, flag)
                checked += 1
    assert checked >= 20, checked


def test_readme_picture_is_what_its_script_draws(tmp_path):
    import sys
    svg = tmp_path / "exchange.svg"
    subprocess.run([sys.executable, os.path.join(REPO, "examples", "exchange_figure.py"), "--out",
                    str(svg)], check=True, timeout=300)
    assert svg.read_text() == open(os.path.join(REPO, "docs", "exchange.svg")).read()
    assert "](docs/exchange.svg)" in open(os.path.join(REPO, "README.md")).read()


def _instructions(path):
    """Dockerfile instructions, continuation lines joined, comments dropped."""
    text = open(path).read().replace("\\\n", " ")
    return [" ".join(l.split()) for l in text.splitlines() if l.strip() and not l.lstrip().startswith("#")]


def test_dockerfile_runs_setup_and_the_ci_test_command():
    docker = _instructions(os.path.join(REPO, "docker", "Dockerfile"))
    # the base image is an argument (python:3.11 on Debian 12 by default) that every stage uses
    assert "ARG BASE=python:3.11-slim-bookworm" in docker
    froms = [l.split()[1] for l in docker if l.startswith("FROM ")]
    assert len(froms) == 2 and set(froms) == {"${BASE}"}, froms
    # setup.sh installs everything but the package before the source is copied in (a code change
    # does not redo it), then once more with the source: the package and the stack's check
    deps = [i for i, l in enumerate(docker)
            if l.startswith("RUN ") and "HOROVOD_TWOBIT_SKIP_PACKAGE=1 bash scripts/setup.sh" in l]
    source = [i for i, l in enumerate(docker) if l.startswith("COPY --from=source ")]
    full = [i for i, l in enumerate(docker) if l == "RUN bash scripts/setup.sh"]
    assert len(deps) == len(source) == len(full) == 1 and deps[0] < source[0] < full[0], docker
    assert not any(l.startswith(("COPY . ", "ADD ")) for l in docker[deps[0]:]), docker
    ci_cmd = _commands(open(os.path.join(REPO, ".ci", "run")).read())[-1]
    cmd = [l for l in docker if l.startswith("CMD ")][-1]
    words = [w.strip().strip('"') for w in re.match(r"CMD \[(.*)\]", cmd).group(1).split(",")]
    assert " ".join(words) == ci_cmd


def test_ci_builds_the_image_and_trains_in_it_before_the_test_command():
    cmds = _commands(open(os.path.join(REPO, ".ci", "run")).read())
    setup = cmds.index("bash scripts/setup.sh")  # the host's Horovod wheel, which the image reuses
    image = [i for i, c in enumerate(cmds) if c.startswith("bash docker/build.sh bash scripts/demo.sh")]
    assert image and setup < image[0] < len(cmds) - 1, cmds


def test_podman_settings():
    conf = open(os.path.join(REPO, "docker", "containers.conf")).read()
    for line in ('runtime = "runc"', 'cgroup_manager = "cgroupfs"', 'events_logger = "file"',
                 'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]'):
        assert re.search("^" + re.escape(line) + "$", conf, re.M), line


def test_docker_scripts_parse_and_host_settings_do_nothing_without_host_files(tmp_path):
    subprocess.run(["bash", "-n", os.path.join(REPO, "docker", "build.sh")], check=True)
    out = subprocess.run(["sh", os.path.join(REPO, "docker", "host-settings.sh"), str(tmp_path)],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=True)
    assert out.stdout == ""


def test_pip_settings_for_the_image(tmp_path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("pip_settings",
                                                  os.path.join(REPO, "docker", "pip_settings.py"))
    ps = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ps)
    conf = ps.parse("\n".join([
        ":env:.cert='/etc/ssl/certs/ca-certificates.crt'",
        ":env:.default-timeout='180'",
        ":env:.find-links='/opt/wheels'",
        "global.cert='/somewhere/else.pem'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/pypi/simple https://mirror.example/simple'",
        "global.find-links='/ignored/because/env/wins'",
        "global.trusted-host='mirror.example'",
        "something unrelated",
    ]))
    assert conf["find-links"] == "/opt/wheels" and conf["cert"] == "/etc/ssl/certs/ca-certificates.crt"
    text, links, left_out = ps.translate(conf)
    assert text.splitlines() == ["[global]", "cert = /etc/ssl/certs/ca-certificates.crt",
                                 "extra-index-url = https://mirror.example/simple",
                                 "trusted-host = mirror.example", "default-timeout = 180"]
    assert links == ["/opt/wheels"] and left_out == ["file:///opt/pypi/simple"]
    assert ps.translate({})[0] == "[global]\n" and ps.translate({}, cert=True)[0].count("cert =") == 1


# ------------------------------------------------------------------ installing into an existing environment

def _pip_env():
    """pip without this machine's configuration (indexes, find-links, constraints): only what a test gives it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


def _horovod_range():
    from packaging.requirements import Requirement
    text = open(os.path.join(REPO, "pyproject.toml")).read()
    deps = re.search(r"^dependencies = (\[.*?\])", text, re.M | re.S).group(1)
    reqs = [Requirement(d) for d in re.findall(r'"([^"]+)"', deps)]
    return [r for r in reqs if r.name == "horovod"][0].specifier


@pytest.fixture(scope="module")
def wheel_dir(tmp_path_factory):
    """This package's wheel, built from a copy of the sources (the checkout stays as it is)."""
    import shutil
    import sys
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), src / name)
    shutil.copytree(os.path.join(REPO, "horovod_twobit"), src / "horovod_twobit",
                    ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "--no-index", "-w", str(tmp / "dist"), str(src)], env=_pip_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return tmp / "dist"


def test_wheel_ships_the_op_sources_and_the_profiles(wheel_dir):
    """Files beside the modules that the package reads at run time are in the wheel: the CPU ops'
    sources and header (native_ops.SOURCES, HEADERS) and the profiles."""
    import zipfile
    (wheel,) = os.listdir(wheel_dir)
    names = zipfile.ZipFile(os.path.join(wheel_dir, wheel)).namelist()
    ops = [f for f in os.listdir(os.path.join(REPO, "horovod_twobit", "tensorflow", "codec"))
           if f.endswith((".cc", ".h"))]
    assert {"segment_levels.cc", "bucket_encode.cc", "bucket_finish.cc", "twobit_ops.h"} <= set(ops)
    profiles = os.path.join(REPO, "horovod_twobit", "model", "profiles")
    want = ["horovod_twobit/tensorflow/codec/" + f for f in ops] + [
        "horovod_twobit/model/profiles/" + f for f in os.listdir(profiles)]
    assert sorted(set(want) - set(names)) == [], names


def _venv(path, packages):
    """A throwaway environment that sees the given packages of the test's environment (symbolic
    links in a folder on its path), as an environment that already has them installed."""
    import sys
    import sysconfig
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    py = str(path / "bin" / "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stack, there = sysconfig.get_paths()["purelib"], path / "there"
    there.mkdir()
    for name in os.listdir(stack):
        if packages(name):
            os.symlink(os.path.join(stack, name), there / name)
    with open(os.path.join(site, "there.pth"), "w") as f:
        f.write(str(there) + "\n")
    return py, site, str(there)


def _fake_dist(site, name, version):
    d = os.path.join(site, "%s-%s.dist-info" % (name, version))
    os.makedirs(d)
    with open(os.path.join(d, "METADATA"), "w") as f:
        f.write("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (name, version))
    open(os.path.join(d, "RECORD"), "w").close()


def test_setup_builds_a_horovod_in_the_declared_range():
    """The one Horovod that can be built here (scripts/setup.sh's), and the one installed, are in range."""
    import importlib.metadata
    setup = open(os.path.join(REPO, "scripts", "setup.sh")).read()
    built = re.search(r"^HOROVOD_VERSION=(\S+)$", setup, re.M).group(1)
    spec = _horovod_range()
    assert built in spec and importlib.metadata.version("horovod") in spec, (built, spec)


def _setup(venv, *args, **settings):
    env = dict(os.environ, HOROVOD_TWOBIT_VENV=str(venv),
               HOROVOD_TWOBIT_SETUP_LOG=str(venv.parent / "setup.log"), **settings)
    return subprocess.run(["bash", os.path.join(REPO, "scripts", "setup.sh"), *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)


def test_setup_does_nothing_while_nothing_changed(tmp_path):
    """setup.sh returns at once while its key (this script, the settings, the venv's packages)
    matches the one its last setup left, and checks everything again when any of them changed."""
    venv = tmp_path / "venv"
    site = venv / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    (venv / "bin").mkdir()
    py = venv / "bin" / "python"
    py.write_text("#!/bin/sh\nexit 1\n")  # any real work with this venv fails
    py.chmod(0o755)
    ready = venv / ".horovod-twobit-ready"
    key = _setup(venv, "--ready-key").stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", key), key
    ready.write_text(key + "\n")
    res = _setup(venv)
    assert res.returncode == 0 and "nothing changed since its last setup" in res.stdout, res.stdout
    assert ready.read_text().strip() == key
    # a package installed (a name more in site-packages), or another setting: another key
    (site / "numpy-9.9.dist-info").mkdir()
    assert _setup(venv, "--ready-key").stdout.strip() != key
    (site / "numpy-9.9.dist-info").rmdir()
    assert _setup(venv, "--ready-key").stdout.strip() == key
    other = _setup(venv, "--ready-key", HOROVOD_TWOBIT_TORCH_INDEX="http://127.0.0.1:9/")
    assert other.stdout.strip() != key
    # an old key: the whole setup runs (its first pip step fails with this venv) and the old key
    # is gone, so a failed setup is never taken as ready
    ready.write_text("0" * 64 + "\n")
    res = _setup(venv)
    assert res.returncode == 1 and "nothing changed" not in res.stdout, res.stdout
    assert "FAILED: pip install of the Python packages" in res.stdout, res.stdout
    assert not ready.exists() and (tmp_path / "setup.log").exists()


def test_setup_key_where_the_script_stands_alone(tmp_path):
    """The Docker image's dependency layer copies scripts/setup.sh without the rest of the source:
    the key a finished setup writes is made there too (no pyproject.toml), and the source's
    pyproject.toml, once copied in, changes it."""
    import shutil
    alone = tmp_path / "repo" / "scripts"
    alone.mkdir(parents=True)
    shutil.copy(os.path.join(REPO, "scripts", "setup.sh"), alone / "setup.sh")
    venv = tmp_path / "repo" / ".venv"
    env = dict(os.environ, HOROVOD_TWOBIT_VENV=str(venv))
    def key():
        res = subprocess.run(["bash", str(alone / "setup.sh"), "--ready-key"], env=env,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stderr == "", res.stdout + res.stderr
        assert re.fullmatch(r"[0-9a-f]{64}\n", res.stdout), res.stdout
        return res.stdout
    without = key()
    shutil.copy(os.path.join(REPO, "pyproject.toml"), tmp_path / "repo" / "pyproject.toml")
    assert key() != without


def test_pip_install_keeps_the_environments_horovod(tmp_path, wheel_dir):
    """`pip install horovod-twobit` into an environment that has Horovod (this stack's: torch,
    TensorFlow, Horovod 0.28.1) installs this package alone: Horovod, NumPy and the rest stay."""
    import json
    # everything but this package (installed here in editable mode)
    py, site, stack = _venv(tmp_path / "env", lambda n: not n.lower().startswith(
        ("horovod_twobit", "__editable__", "horovod-twobit")))
    report = tmp_path / "report.json"
    out = subprocess.run([py, "-m", "pip", "install", "--no-index", "--find-links", str(wheel_dir),
                          "--report", str(report), "horovod-twobit"], env=_pip_env(),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    installed = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
    assert installed == ["horovod-twobit"], installed
    assert "Uninstalling" not in out.stdout, out.stdout
    assert sorted(n for n in os.listdir(site) if "horovod" in n.lower()) == sorted(
        n for n in os.listdir(site) if n.startswith("horovod_twobit")), os.listdir(site)
    where = subprocess.run([py, "-c", "import importlib.metadata as m, horovod_twobit; "
                            "d = m.distribution('horovod'); print(d.version, d.locate_file(''), horovod_twobit.__file__)"],
                           capture_output=True, text=True, check=True, cwd=str(tmp_path),
                           env=_pip_env()).stdout.split()
    assert where[0] == "0.28.1" and where[1].startswith(stack) and where[2].startswith(site), where


@pytest.mark.parametrize("horovod, kept", [("0.28.0", True), ("0.28.1", True),
                                           ("0.27.0", False), ("0.29.0", False)])
def test_pip_resolves_against_the_horovod_range(tmp_path, wheel_dir, horovod, kept):
    """pip's resolution alone (metadata, nothing imported): a Horovod in the declared range is kept
    as it is; one outside makes pip look for another (here, with no index, it finds none and stops)."""
    import json
    py, site, _ = _venv(tmp_path / "env", lambda n: n == "pip")
    _fake_dist(site, "horovod", horovod)
    _fake_dist(site, "numpy", "1.26.4")
    assert (horovod in _horovod_range()) == kept
    report = tmp_path / "report.json"
    out = subprocess.run([py, "-m", "pip", "install", "--dry-run", "--no-index", "--find-links",
                          str(wheel_dir), "--report", str(report), "horovod-twobit"],
                         env=_pip_env(), capture_output=True, text=True, timeout=300)
    if kept:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        installed = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
        assert installed == ["horovod-twobit"], installed
    else:
        assert out.returncode != 0 and "No matching distribution found for horovod" in out.stderr, out.stderr
