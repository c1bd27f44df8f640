"""Turns the build host's pip settings into what an image build can use (run by docker/build.sh).

    python3 docker/pip_settings.py OUT_DIR [--cert]

reads `python3 -m pip config list` (files and PIP_* variables, the variables winning as in pip),
writes OUT_DIR/pip.conf for the image and hard-links (or copies) the wheels of local find-links
folders into OUT_DIR/wheels/. Remote indexes, find-links and hosts are kept; local indexes and
find-links are paths on the host, so they are left out (the wheels are carried instead). With
--cert, or when the host's pip sets one, pip.conf points `cert` at the image's CA bundle, which
then holds the host's extra CA certificates.
"""

import glob
import os
import re
import shutil
import subprocess
import sys

CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"
URL_KEYS = ("index-url", "extra-index-url", "find-links")
COPY_KEYS = ("trusted-host", "timeout", "default-timeout", "retries", "proxy")


def parse(text):
    """`pip config list` output -> {key: value}; ':env:' entries win over the files."""
    conf, from_env = {}, set()
    for line in text.splitlines():
        m = re.match(r"^(:env:|global|install|download|wheel)\.([\w-]+)='(.*)'$", line.strip())
        if not m:
            continue
        where, key, value = m.groups()
        if where == ":env:" or key not in from_env:
            conf[key] = value
            if where == ":env:":
                from_env.add(key)
    return conf


def is_local(url):
    return url.startswith("file:") or not re.match(r"^[a-zA-Z][\w+.-]*://", url)


def local_path(url):
    return re.sub(r"^file://", "", url)


def translate(conf, cert=False):
    """-> (pip.conf text, local find-links folders, left-out local indexes)."""
    lines = ["[global]"]
    if cert or conf.get("cert"):
        lines.append("cert = " + CA_BUNDLE)
    for key in URL_KEYS:
        keep = [u for u in conf.get(key, "").split() if not is_local(u)]
        if keep:
            lines.append("%s = %s" % (key, " ".join(keep)))
    for key in COPY_KEYS:
        if conf.get(key):
            lines.append("%s = %s" % (key, conf[key]))
    links = [local_path(u) for u in conf.get("find-links", "").split() if is_local(u)]
    left_out = [u for k in ("index-url", "extra-index-url") for u in conf.get(k, "").split() if is_local(u)]
    return "\n".join(lines) + "\n", links, left_out


def main(argv):
    out, cert = argv[0], "--cert" in argv[1:]
    text = subprocess.run([sys.executable, "-m", "pip", "config", "list"], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True).stdout
    conf_text, links, left_out = translate(parse(text), cert)
    os.makedirs(os.path.join(out, "wheels"), exist_ok=True)
    for d in links:
        for w in sorted(glob.glob(os.path.join(d, "*.whl"))):
            dst = os.path.join(out, "wheels", os.path.basename(w))
            print("carried from find-links:", w)
            try:
                os.link(w, dst)
            except OSError:
                shutil.copy2(w, dst)
    for u in left_out:
        print("left out (an index on the host's disk):", u)
    with open(os.path.join(out, "pip.conf"), "w") as f:
        f.write(conf_text)
    print(conf_text, end="")


if __name__ == "__main__":
    main(sys.argv[1:])
