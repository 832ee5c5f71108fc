#!/usr/bin/env bash
# Creates (or reuses) the project's virtual environment and prints its path on the last line.
#
# The venv lives outside the clone (CI uses a fresh clone every time) under
# ${LATTE_CACHE:-~/.cache/latte-plugin}, keyed by a hash of tools/requirements.txt and
# SETUP_REV below, so a warm machine reuses it. The mmcv 2.1.0 wheel (a ~13 minute compile
# of its CPU ops) is built once and kept in the same cache, so even a new venv does not
# compile it again. Bump SETUP_REV when the steps below change what gets installed.
#
# Detectron2 (not on PyPI) is installed into the same venv from its official source at
# the pinned commit D2_COMMIT (the one the README's parity figures come from):
#   LATTE_DETECTRON2_SRC=<local checkout or source archive>   (offline machines, CI)
#   otherwise git+<official repository>@D2_COMMIT over the network;
#   LATTE_DETECTRON2_SRC=none skips it. When neither source works, one line says so and
#   everything else still runs (the detectron2 tests then skip with the reason).
set -euo pipefail
SETUP_REV=2
D2_COMMIT=02b5c4e295e990042a714712c21dc79b731e8833
D2_REPO=https://github.com/facebookresearch/detectron2
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache="${LATTE_CACHE:-$HOME/.cache/latte-plugin}"
py="${LATTE_PYTHON:-python3.11}"
command -v "$py" >/dev/null || py=python3
key="$( (cat "$here/tools/requirements.txt"; echo "rev=$SETUP_REV d2=$D2_COMMIT") | sha256sum | cut -c1-12)"
venv="${LATTE_VENV:-$cache/venv-$key}"
wheels="$cache/wheels"
log() { echo "[setup_env] $*" >&2; }

if [ -f "$venv/.latte-ready" ]; then
  log "reusing $venv"
else
  mkdir -p "$cache" "$wheels"
  pip_log="$cache/setup-$key.log"
  log "creating $venv (fresh set-up: about 20 minutes, most of it the mmcv compile; pip log: $pip_log)"
  : > "$pip_log"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  pip() { "$venv/bin/python" -m pip "$@" >>"$pip_log" 2>&1 || { tail -n 40 "$pip_log" >&2; log "pip $* failed"; exit 1; }; }
  # mmcv's setup.py imports pkg_resources (setuptools<70); pip<26 still builds it.
  pip install "pip<26" wheel "setuptools<70" ninja
  log "installing torch 2.9.1, mmengine, transformers, ... (tools/requirements.txt)"
  pip install -r "$here/tools/requirements.txt"
  mmcv_whl="$(ls "$wheels"/mmcv-2.1.0-*.whl 2>/dev/null | head -n1 || true)"
  if [ -z "$mmcv_whl" ]; then
    log "compiling mmcv 2.1.0 with its CPU ops (about 13 minutes on 2 cores)"
    tmpw="$(mktemp -d)"
    MMCV_WITH_OPS=1 FORCE_CUDA=0 MAX_JOBS="${MAX_JOBS:-2}" \
      pip wheel --no-build-isolation --no-deps -w "$tmpw" mmcv==2.1.0
    mv "$tmpw"/mmcv-2.1.0-*.whl "$wheels"/
    mmcv_whl="$(ls "$wheels"/mmcv-2.1.0-*.whl | head -n1)"
  else
    log "reusing the compiled $(basename "$mmcv_whl")"
  fi
  pip install --no-deps "$mmcv_whl"
  pip install mmdet==3.3.0 -r "$here/tools/requirements.txt"
  "$venv/bin/python" -c "import mmcv.ops, mmdet.models, torch; print('[setup_env] mmcv ops OK, torch', torch.__version__)" >&2
  touch "$venv/.latte-ready"
fi

# Detectron2 at the pinned commit: its own marker, so a venv made where no source was
# reachable gets it on a later call that has one.
d2_marker="$venv/.latte-detectron2-$D2_COMMIT"
d2_src="${LATTE_DETECTRON2_SRC:-git+$D2_REPO@$D2_COMMIT}"
case "$d2_src" in none|git+*|/*) ;; *) d2_src="$PWD/$d2_src" ;; esac
if [ ! -f "$d2_marker" ] && [ "$d2_src" != none ]; then
  d2_log="$cache/detectron2-$key.log"
  log "installing detectron2 $D2_COMMIT from $d2_src (about 1 minute; log: $d2_log)"
  if [ -n "${LATTE_DETECTRON2_SRC:-}" ] && [ ! -e "$d2_src" ]; then
    log "detectron2 not installed: LATTE_DETECTRON2_SRC=$d2_src does not exist; point it at a detectron2 checkout or source archive at commit $D2_COMMIT (detectron2 tests will skip)"
  elif MAX_JOBS="${MAX_JOBS:-2}" "$venv/bin/python" -m pip install --no-build-isolation "$d2_src" >"$d2_log" 2>&1 \
       && "$venv/bin/python" -c "import detectron2.evaluation, detectron2._C" >>"$d2_log" 2>&1; then
    touch "$d2_marker"
  else
    log "detectron2 not installed (could not build $d2_src, see $d2_log); set LATTE_DETECTRON2_SRC to a detectron2 checkout or source archive at commit $D2_COMMIT (detectron2 tests will skip)"
  fi
fi
# The package itself is installed editable from this checkout on every call (seconds),
# so a venv shared between clones always points at the clone being run.
"$venv/bin/python" -m pip install -q --no-deps --no-build-isolation -e "$here" >/dev/null 2>&1 \
  || "$venv/bin/python" -m pip install --no-deps --no-build-isolation -e "$here" >&2
echo "$venv"
