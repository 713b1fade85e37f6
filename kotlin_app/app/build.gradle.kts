plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

android {
    namespace = "org.zerolock.app"
    compileSdk = 35

    defaultConfig {
        applicationId = "org.zerolock.app"
        minSdk = 29 // PowerManager.currentThermalStatus
        targetSdk = 35
        versionCode = 1
        versionName = "0.1.0"
        ndk {
            // the ExecuTorch AAR ships these two ABIs
            abiFilters += listOf("arm64-v8a", "x86_64")
        }
    }

    buildTypes {
        release {
            isMinifyEnabled = false
            proguardFiles(getDefaultProguardFile("proguard-android-optimize.txt"), "proguard-rules.pro")
        }
    }

    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }
    kotlinOptions {
        jvmTarget = "17"
    }
    packaging {
        jniLibs.useLegacyPackaging = false
    }
}

dependencies {
    implementation(project(":core"))
    // ExecuTorch's Android runtime (org.pytorch.executorch.Module / EValue / Tensor, and
    // training.TrainingModule: the only loader that takes a .pte plus a .ptd; see README.md).
    // The host side exports with executorch 1.5.1. The newest executorch-android release found on
    // Maven Central while writing this was 1.0.1 (no 1.5.x AAR could be confirmed offline); bump it
    // to the release matching the exporter when one is published: a .pte must be read by a runtime
    // at least as new as the exporter that wrote it.
    implementation("org.pytorch:executorch-android:1.0.1")
    // (its POM brings fbjni and soloader's nativeloader, which the JNI side needs)
}
