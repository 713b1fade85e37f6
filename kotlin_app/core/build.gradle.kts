// The plain Kotlin core as a JVM library, so the Android app can depend on it.
// (kotlin_app/run_tests.sh builds and tests the same sources with kotlinc directly, without Gradle.)
plugins {
    id("org.jetbrains.kotlin.jvm")
}

kotlin {
    jvmToolchain(17)
}

dependencies {
    testImplementation(platform("org.junit:junit-bom:5.11.4"))
    testImplementation("org.junit.jupiter:junit-jupiter")
    testRuntimeOnly("org.junit.platform:junit-platform-launcher")
}

tasks.test {
    useJUnitPlatform()
    // tests read tests/vectors/ and kotlin_app/vectors/ from the repository
    systemProperty("zerolock.repoRoot", rootDir.parentFile.absolutePath)
}
