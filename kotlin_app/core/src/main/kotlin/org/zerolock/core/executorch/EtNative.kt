@file:JvmName("EtNative")

package org.zerolock.core.executorch

import java.io.File

/*
 * The JNI entry points of kotlin_app/jni/zl_executorch.cpp (libzl_executorch.so, built by
 * kotlin_app/run_tests.sh against the executorch wheel). Use [ExecuTorchBackend], not these.
 */

/** Sets up ExecuTorch's log sink and thread pool ([threads] 0: its default size); returns what is registered. */
internal external fun nInitRuntime(threads: Int, verbose: Boolean): String
/** Loads [pte] with its external weights [ptd] (null: none); returns a handle for the calls below. */
internal external fun nLoad(pte: String, ptd: String?): Long
internal external fun nClose(handle: Long)
internal external fun nMethodNames(handle: Long): Array<String>
/** Whether the program's methods share one working arena (its phase 1 outputs are planned apart). */
internal external fun nSharedArenas(handle: Long): Boolean
/** See the C++ side: [generation], then per output a `long[] {dtype, dims...}` and its bytes or null (kept). */
internal external fun nRun(handle: Long, method: String, inData: Array<Any?>, inDtype: IntArray, inShape: Array<LongArray?>,
                          keptIndex: IntArray, keptMethod: String?, keptGeneration: Long, keep: BooleanArray?): Array<Any?>

/** Loads libzl_executorch.so once per process. */
object EtLibrary {
    /** `-Dzerolock.executorchJni=PATH` overrides where the library is looked for. */
    const val PROPERTY = "zerolock.executorchJni"
    const val FILE = "libzl_executorch.so"

    @Volatile private var loaded: String? = null

    /** The library's path: the property, else build/native/ beside the build/classes/main these classes came from. */
    fun path(): File {
        System.getProperty(PROPERTY)?.let { return File(it) }
        val classes = runCatching { File(EtLibrary::class.java.protectionDomain.codeSource.location.toURI()) }.getOrNull()
        val build = generateSequence(classes) { it.parentFile }.firstOrNull { it.name == "build" && File(it, "native").isDirectory }
        return File(build ?: File("kotlin_app/build"), "native/$FILE")
    }

    /** Loads the library and sets up the runtime ([threads] 0: ExecuTorch's default); returns its registry summary. */
    @Synchronized
    fun ensureLoaded(threads: Int = 0): String {
        if (loaded == null) {
            val f = path()
            if (!f.isFile) throw IllegalStateException("$FILE not found at $f: build it with kotlin_app/run_tests.sh --build-only (or set -D$PROPERTY)")
            try {
                System.load(f.absolutePath)
            } catch (e: UnsatisfiedLinkError) {
                throw IllegalStateException("cannot load $f (${e.message}): rebuild it with kotlin_app/run_tests.sh --build-only")
            }
            loaded = f.path
        }
        return nInitRuntime(threads, System.getenv("ZL_EXECUTORCH_VERBOSE") == "1")
    }
}
