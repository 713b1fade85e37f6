#!/usr/bin/env bash
# Build the Kotlin core's ExecuTorch bridge (libzl_executorch.so) with the system g++ against the
# runtime libraries and headers of the executorch wheel in the project's virtualenv. Nothing is
# downloaded. Called by kotlin_app/run_tests.sh; re-runs skip the build when nothing changed.
#
#   kotlin_app/jni/build.sh OUT_DIR        (ZL_PYTHON: the interpreter whose executorch to use;
#                                           default .venv/bin/python of the repository)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
OUT="${1:?usage: jni/build.sh OUT_DIR}"
PY="${ZL_PYTHON:-$REPO/.venv/bin/python}"
die() { echo "jni/build.sh: $*" >&2; exit 1; }

[ -x "$PY" ] || die "no Python at $PY: run scripts/setup.sh first (the bridge links the executorch wheel's libraries)"
command -v g++ >/dev/null || die "g++ not found: apt-get install -y g++"
# find_spec, not import: importing executorch loads torch (seconds) and is not needed here
ET="$("$PY" -c 'import importlib.util as u; s = u.find_spec("executorch"); print(list(s.submodule_search_locations)[0] if s else "")')"
[ -n "$ET" ] && [ -f "$ET/lib/libexecutorch.so" ] && [ -d "$ET/include/executorch" ] ||
  die "the executorch wheel in $PY has no lib/libexecutorch.so or include/: pip install executorch==1.5.1 (scripts/setup.sh)"
JAVA_HOME="${JAVA_HOME:-$(dirname "$(dirname "$(readlink -f "$(command -v java)")")")}"
if [ ! -f "$JAVA_HOME/include/jni.h" ]; then  # a JRE on PATH: any JDK's jni.h does (JNI is stable)
  for j in /usr/lib/jvm/*/include/jni.h; do [ -f "$j" ] && { JAVA_HOME="$(dirname "$(dirname "$j")")"; break; }; done
fi
[ -f "$JAVA_HOME/include/jni.h" ] || die "no jni.h under $JAVA_HOME/include: install a full JDK (apt-get install -y openjdk-17-jdk-headless) or set JAVA_HOME"

SO="$OUT/libzl_executorch.so"
STAMP="$(cat "$HERE"/*.cpp "$0" | sha256sum | cut -d' ' -f1) $ET $(g++ -dumpfullversion)"
if [ -f "$SO" ] && [ -f "$SO.stamp" ] && [ "$(cat "$SO.stamp")" = "$STAMP" ]; then
  echo "[jni] $SO up to date"; exit 0
fi
mkdir -p "$OUT"
rm -f "$SO.stamp"
# Flags the wheel's headers need (its share/cmake/executorch-config.cmake): both include dirs
# (the vendored c10 too), C10_USING_CUSTOM_GENERATED_MACROS (else c10 wants torch's generated
# macros), ET_EVENT_TRACER_ENABLED and ET_USE_THREADPOOL as the libraries were built (class
# layouts), C++17, and -isystem for module.h's deprecation warnings. The libraries use the new
# C++11 string ABI, Debian g++'s default.
CXXFLAGS=(-std=c++17 -O2 -fPIC -Wall -DC10_USING_CUSTOM_GENERATED_MACROS -DET_EVENT_TRACER_ENABLED -DET_USE_THREADPOOL
  -isystem "$ET/include" -isystem "$ET/include/executorch/runtime/core/portable_type/c10"
  -I"$JAVA_HOME/include" -I"$JAVA_HOME/include/linux")
# The kernel and backend libraries only register themselves from static initialisers: nothing
# references them, so they are linked with --no-as-needed or an --as-needed toolchain drops them
# (and methods then fail: "Backend XnnpackBackend is not registered"). RUNPATH to the wheel's lib
# dir; the wheel's libraries find each other through their own $ORIGIN.
LIBS=(-L"$ET/lib" -Wl,--enable-new-dtags,-rpath,"$ET/lib" -Wl,--push-state,--no-as-needed
  -lexecutorch -lexecutorch_threadpool -lexecutorch_kernels_optimized -lexecutorch_kernels_quantized
  -lexecutorch_backend_xnnpack -Wl,--pop-state -Wl,--no-undefined)
echo "[jni] building $SO against $ET"
g++ "${CXXFLAGS[@]}" -shared -o "$SO.tmp" "$HERE/zl_executorch.cpp" "${LIBS[@]}"
mv "$SO.tmp" "$SO"
echo "$STAMP" > "$SO.stamp"
