"""The stack installs and works: real horovodrun jobs with Gloo and MPI, PyTorch and TensorFlow."""

import os
import re
import subprocess

import pytest

import jobs

REPO = os.path.dirname(jobs.HERE)


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
@pytest.mark.parametrize("mpi", [False, True], ids=["gloo", "mpi"])
def test_allreduce_and_allgather(framework, mpi):
    res = jobs.run(2, "smoke.py", framework, mpi=mpi, timeout=180)
    for rank in range(2):
        assert "rank %d of 2 %s: OK" % (rank, framework) in res.output, res


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
