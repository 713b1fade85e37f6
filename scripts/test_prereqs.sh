#!/usr/bin/env bash
# What the test suite needs beyond .venv, from Debian's packages (the one place they are named):
#   adb          tests/test_adb.py, tests/test_adb_run.py (a real adb server; the emulated adbd attaches to it)
#   junit5       the Kotlin core's JVM tests (kotlin_app/run_tests.sh: JUnit's console launcher)
#   wordnet-base tests/test_wordnet.py and --data wordnet (WordNet's noun glosses)
#   npm          kotlin_app/run_tests.sh installs the Kotlin compiler from npm's kotlin-compiler
#   g++, openjdk-17-jdk-headless (jni.h)  kotlin_app/run_tests.sh builds the JNI bridge (kotlin_app/jni)
# Installed with apt-get when missing (needs root); without root, one line names what to install.
set -euo pipefail
need=()
command -v adb >/dev/null || need+=(adb)
[ -f /usr/share/java/junit-platform-console-standalone.jar ] || need+=(junit5)
[ -f "${WNSEARCHDIR:-/usr/share/wordnet}/data.noun" ] || need+=(wordnet-base)
command -v npm >/dev/null || [ -x kotlin_app/.tools/node_modules/kotlin-compiler/bin/kotlinc ] || need+=(npm)
command -v g++ >/dev/null || need+=(g++)  # kotlin_app/jni: the Kotlin phones' ExecuTorch bridge
ls /usr/lib/jvm/*/include/jni.h >/dev/null 2>&1 || need+=(openjdk-17-jdk-headless)  # its jni.h
[ ${#need[@]} = 0 ] && exit 0
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "scripts/test_prereqs.sh: the tests need Debian's ${need[*]}: run 'sudo apt-get install ${need[*]}' (or this script as root)" >&2
  exit 1
fi
echo "[test_prereqs] apt-get install ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null 2>&1 \
  || { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
