#!/usr/bin/env bash
# Compile the Android layer (kotlin_app/app/src/main/java) with the project's pinned kotlinc against
# an android.jar, the ExecuTorch Android classes and the core, without Gradle and without network.
# Not part of the default test run: it needs files this project cannot download.
#
#   kotlin_app/check_android_compile.sh
#
# Inputs (environment):
#   ANDROID_JAR        android.jar of API level >= 34 (default: $ANDROID_HOME/platforms/android-35/android.jar,
#                      else $ANDROID_SDK_ROOT/platforms/android-35/android.jar)
#   EXECUTORCH_AAR     executorch-android-<version>.aar (its classes.jar is used), or
#   EXECUTORCH_CLASSES a jar or directory with the org.pytorch.executorch classes
#   EXTRA_CLASSPATH    optional, e.g. fbjni's classes (colon-separated)
#
# Exit status: 0 compiled, 1 compile error, 2 an input is missing (nothing was checked).
# Builds the core first (run_tests.sh --build-only --no-install). Outputs: kotlin_app/build/android-check/.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="$HERE/build/android-check"
KOTLINC="$HERE/.tools/node_modules/kotlin-compiler/bin/kotlinc"

missing() { echo "check_android_compile.sh: $* -- nothing was checked" >&2; exit 2; }

ANDROID_JAR="${ANDROID_JAR:-}"
if [ -z "$ANDROID_JAR" ]; then
  for sdk in "${ANDROID_HOME:-}" "${ANDROID_SDK_ROOT:-}"; do
    [ -n "$sdk" ] && [ -f "$sdk/platforms/android-35/android.jar" ] && { ANDROID_JAR="$sdk/platforms/android-35/android.jar"; break; }
  done
fi
[ -n "$ANDROID_JAR" ] && [ -f "$ANDROID_JAR" ] || missing "no android.jar (set ANDROID_JAR or ANDROID_HOME; Debian 12 packages none)"

rm -rf "$OUT"; mkdir -p "$OUT/classes" "$OUT/r"
ET_CP=""
if [ -n "${EXECUTORCH_AAR:-}" ]; then
  [ -f "$EXECUTORCH_AAR" ] || missing "EXECUTORCH_AAR=$EXECUTORCH_AAR does not exist"
  (cd "$OUT" && unzip -o -q "$EXECUTORCH_AAR" classes.jar) || missing "$EXECUTORCH_AAR has no classes.jar"
  ET_CP="$OUT/classes.jar"
elif [ -n "${EXECUTORCH_CLASSES:-}" ]; then
  [ -e "$EXECUTORCH_CLASSES" ] || missing "EXECUTORCH_CLASSES=$EXECUTORCH_CLASSES does not exist"
  ET_CP="$EXECUTORCH_CLASSES"
else
  missing "no ExecuTorch Android classes (set EXECUTORCH_AAR to org.pytorch:executorch-android's .aar)"
fi

bash "$HERE/run_tests.sh" --build-only --no-install >/dev/null
CORE="$HERE/build/classes/main"

# R: the ids Gradle's resource step would generate, from the names in app/src/main/res
{
  echo "package org.zerolock.app;"
  echo "public final class R {"
  echo "  public static final class string {"
  sed -n 's/.*<string name="\([A-Za-z0-9_]*\)".*/    public static final int \1 = 0;/p' "$HERE/app/src/main/res/values/strings.xml"
  echo "  }"
  echo "  public static final class drawable {"
  for f in "$HERE"/app/src/main/res/drawable/*; do n="$(basename "${f%.*}")"; echo "    public static final int $n = 0;"; done
  echo "  }"
  echo "}"
} > "$OUT/r/R.java"
javac -nowarn -d "$OUT/r" "$OUT/r/R.java"

CP="$ANDROID_JAR:$ET_CP:$CORE:$OUT/r${EXTRA_CLASSPATH:+:$EXTRA_CLASSPATH}"
echo "[android-check] kotlinc $(basename "$(dirname "$(dirname "$KOTLINC")")") against $ANDROID_JAR + $ET_CP + core"
if JAVA_OPTS="${JAVA_OPTS:--Xmx1g}" "$KOTLINC" -jvm-target 17 -no-reflect -cp "$CP" -d "$OUT/classes" "$HERE/app/src/main/java"; then
  echo "[android-check] app sources compiled: $(find "$OUT/classes" -name '*.class' | wc -l) classes in $OUT/classes"
else
  echo "check_android_compile.sh: the app does not compile against these APIs" >&2
  exit 1
fi
