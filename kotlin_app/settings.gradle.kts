// ZeroLock Android app: `app` (Android, thin) + `core` (plain Kotlin/JVM library: protocol,
// stage state machine, AdamW, checkpoints). Build with `./gradlew assembleDebug` (see README.md;
// generate the wrapper once with `gradle wrapper --gradle-version 8.11.1`).
pluginManagement {
    repositories {
        google()
        mavenCentral()
        gradlePluginPortal()
    }
}

dependencyResolutionManagement {
    repositoriesMode.set(RepositoriesMode.FAIL_ON_PROJECT_REPOS)
    repositories {
        google()
        mavenCentral()
    }
}

rootProject.name = "zerolock"
include(":core", ":app")
