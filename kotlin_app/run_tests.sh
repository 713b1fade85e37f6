#!/usr/bin/env bash
# Build and test the plain-Kotlin core of the ZeroLock app on the JVM (no Android SDK needed).
#
#   kotlin_app/run_tests.sh                 install toolchain if missing, build, run all JUnit tests
#   kotlin_app/run_tests.sh --build-only    install if missing + build main classes (used by pytest)
#   kotlin_app/run_tests.sh --no-install    never install anything; fail clearly if a tool is missing
#
# Toolchain (pinned):
#   * kotlinc  : npm package kotlin-compiler@$KOTLIN_VERSION, installed into kotlin_app/.tools
#   * JUnit 5  : Debian package junit5 (console launcher /usr/share/java/junit-platform-console-standalone.jar)
#   * JDK 17   : expected on PATH (java, javac not needed)
#   * g++      : builds the ExecuTorch bridge (kotlin_app/jni/) against the executorch wheel in .venv
#                (scripts/setup.sh makes it); the tests also export two small chunks with it
# Outputs go to kotlin_app/build/ (classes/main, classes/test, classpath.txt, native/, test_export/).
# Re-runs skip compilation when neither the sources nor the compiler version changed.
set -euo pipefail

KOTLIN_VERSION="2.4.20"

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/.." && pwd)"
TOOLS="$HERE/.tools"
KC_HOME="$TOOLS/node_modules/kotlin-compiler"
KOTLINC="$KC_HOME/bin/kotlinc"
STDLIB="$KC_HOME/lib/kotlin-stdlib.jar"
BUILD="$HERE/build"
MAIN_OUT="$BUILD/classes/main"
TEST_OUT="$BUILD/classes/test"

BUILD_ONLY=0
INSTALL=1
for arg in "$@"; do
  case "$arg" in
    --build-only) BUILD_ONLY=1 ;;
    --no-install) INSTALL=0 ;;
    -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "run_tests.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

die() { echo "run_tests.sh: $*" >&2; exit 1; }
log() { echo "[run_tests] $*"; }

command -v java >/dev/null || die "java not found: install a JDK >= 17 (apt-get install -y openjdk-17-jdk-headless)"

apt_install() {
  [ "$(id -u)" = 0 ] || die "need root to apt-get install $*"
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y --no-install-recommends "$@" >/dev/null; then
    apt-get update >/dev/null && apt-get install -y --no-install-recommends "$@" >/dev/null
  fi
}

# ---- kotlinc (npm kotlin-compiler, pinned) ---------------------------------------------------
installed_kc_version() {
  [ -f "$KC_HOME/package.json" ] || return 0
  sed -n 's/^ *"version": *"\([^"]*\)".*/\1/p' "$KC_HOME/package.json" | head -n1
}
if [ "$(installed_kc_version)" != "$KOTLIN_VERSION" ] || [ ! -f "$STDLIB" ]; then
  [ "$INSTALL" = 1 ] || die "Kotlin compiler $KOTLIN_VERSION missing in $TOOLS; run kotlin_app/run_tests.sh (without --no-install) to install it"
  if ! command -v npm >/dev/null; then log "installing npm (Debian)"; apt_install npm; fi
  log "installing kotlin-compiler@$KOTLIN_VERSION from npm into $TOOLS"
  mkdir -p "$TOOLS"
  npm install --no-audit --no-fund --prefix "$TOOLS" "kotlin-compiler@$KOTLIN_VERSION" >/dev/null
  [ "$(installed_kc_version)" = "$KOTLIN_VERSION" ] || die "npm did not install kotlin-compiler@$KOTLIN_VERSION"
fi
chmod +x "$KC_HOME"/bin/* 2>/dev/null || true

# ---- JUnit 5 console launcher (Debian junit5) -----------------------------------------------
find_junit() {
  for j in /usr/share/java/junit-platform-console-standalone.jar \
           /usr/share/java/junit-platform-console-standalone-*.jar; do
    [ -f "$j" ] && { echo "$j"; return 0; }
  done
  return 0
}
JUNIT="$(find_junit)"
if [ -z "$JUNIT" ] && [ "$BUILD_ONLY" = 0 ]; then
  [ "$INSTALL" = 1 ] || die "JUnit 5 console launcher missing; run kotlin_app/run_tests.sh (it apt-get installs junit5)"
  log "installing junit5 (Debian)"
  apt_install junit5
  JUNIT="$(find_junit)"
  [ -n "$JUNIT" ] || die "junit5 installed but no junit-platform-console-standalone jar found"
fi

# ---- compile (skipped when inputs are unchanged) --------------------------------------------
stamp_of() {  # stamp_of <extra> <dir>... : hash of all .kt files under the dirs + extra text
  local extra="$1"; shift
  { echo "$extra"; find "$@" -name '*.kt' -type f -print0 | sort -z | xargs -0 sha256sum; } | sha256sum | cut -d' ' -f1
}
compile() {  # compile <name> <out> <classpath> <stamp> <srcdir>...
  local name="$1" out="$2" cp="$3" stamp="$4"; shift 4
  if [ -f "$out.stamp" ] && [ "$(cat "$out.stamp")" = "$stamp" ]; then
    log "$name classes up to date"; return 0
  fi
  log "compiling $name with kotlinc $KOTLIN_VERSION"
  rm -rf "$out" "$out.stamp"; mkdir -p "$out"
  local cparg=()
  [ -n "$cp" ] && cparg=(-cp "$cp")
  JAVA_OPTS="${JAVA_OPTS:--Xmx1g}" "$KOTLINC" -jvm-target 17 -no-reflect -nowarn "${cparg[@]}" -d "$out" "$@"
  echo "$stamp" > "$out.stamp"
}
mkdir -p "$BUILD"
MAIN_SRC="$HERE/core/src/main/kotlin"
TEST_SRC="$HERE/core/src/test/kotlin"
MAIN_STAMP="$(stamp_of "kotlinc $KOTLIN_VERSION" "$MAIN_SRC")"
compile main "$MAIN_OUT" "" "$MAIN_STAMP" "$MAIN_SRC"
echo "$MAIN_OUT:$STDLIB" > "$BUILD/classpath.txt"
# the ExecuTorch bridge (Kotlin phones on the JVM): g++ against the executorch wheel in .venv
bash "$HERE/jni/build.sh" "$BUILD/native"
[ "$BUILD_ONLY" = 1 ] && { log "build only: runtime classpath in $BUILD/classpath.txt, bridge in $BUILD/native"; exit 0; }

# a real two-chunk export and the Python runtime's outputs for ExecuTorchBackendTest (~1 min once)
TEST_EXPORT="$BUILD/test_export"
EXPORT_STAMP="$(cat "$HERE/jni/make_test_export.py" | sha256sum | cut -d' ' -f1)"
if [ ! -f "$TEST_EXPORT/reference.safetensors" ] || [ "$(cat "$TEST_EXPORT.stamp" 2>/dev/null)" != "$EXPORT_STAMP" ]; then
  log "exporting the test chunks into $TEST_EXPORT"
  rm -rf "$TEST_EXPORT" "$TEST_EXPORT.stamp"
  "${ZL_PYTHON:-$REPO/.venv/bin/python}" -W ignore "$HERE/jni/make_test_export.py" "$TEST_EXPORT" >"$BUILD/test_export.log" 2>&1 ||
    die "could not export the test chunks (see $BUILD/test_export.log)"
  echo "$EXPORT_STAMP" > "$TEST_EXPORT.stamp"
fi

TEST_STAMP="$(stamp_of "kotlinc $KOTLIN_VERSION $MAIN_STAMP $JUNIT" "$TEST_SRC")"
compile test "$TEST_OUT" "$MAIN_OUT:$JUNIT" "$TEST_STAMP" "$TEST_SRC"

# ---- run ------------------------------------------------------------------------------------
log "running JUnit ($JUNIT)"
set +e
java -Dzerolock.repoRoot="$REPO" -Dzerolock.testExport="$TEST_EXPORT" -Dzerolock.executorchJni="$BUILD/native/libzl_executorch.so" -jar "$JUNIT" \
  --disable-banner --disable-ansi-colors --details=tree --fail-if-no-tests \
  --class-path "$MAIN_OUT:$TEST_OUT:$STDLIB" --scan-class-path "$TEST_OUT"
rc=$?
set -e
if [ "$rc" -ne 0 ]; then echo "run_tests.sh: JUnit FAILED (exit $rc)" >&2; exit "$rc"; fi
log "all tests passed"
