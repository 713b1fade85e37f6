package org.zerolock.core.executorch

import org.zerolock.core.device.ChainingBackend
import org.zerolock.core.device.MethodBackend
import org.zerolock.core.device.MethodInput
import org.zerolock.core.protocol.DType
import org.zerolock.core.protocol.Tensor
import java.io.File

/**
 * A [MethodBackend] on ExecuTorch's C++ runtime (the executorch wheel's libraries through
 * libzl_executorch.so): what a Kotlin phone on the JVM runs zl-export's programs with, as the
 * Android app does with ExecuTorch's Android library. Outputs a caller keeps
 * ([ChainingBackend.runKeeping]) stay in ExecuTorch's memory until their method runs again;
 * misuse (a missing file, an unknown method, an input of the wrong dtype, shape or size, a stale
 * kept output) is an exception naming it, checked before ExecuTorch runs.
 */
class ExecuTorchBackend private constructor(private var handle: Long, val program: File) : ChainingBackend {
    /** The program's methods (ExecuTorch's training metadata methods `__et_*` included). */
    val methods: Set<String> get() = synchronized(this) { nMethodNames(live()).toSet() }

    /** Whether phase 2 works in the memory phase 1 worked in (one arena for both; zl-export plans
     *  phase 1's outputs, which phase 2 reads, apart from it). False for exports older than that. */
    val sharedArenas: Boolean get() = synchronized(this) { nSharedArenas(live()) }

    private fun live(): Long = if (handle != 0L) handle else throw IllegalStateException("${program.name} was closed")

    override fun run(method: String, inputs: List<Tensor>, outputNames: List<String>): List<Tensor> =
        runKeeping(method, inputs.map { MethodInput.Value(it) }, outputNames, BooleanArray(0)).tensors.map { it!! }

    override fun runKeeping(method: String, inputs: List<MethodInput>, outputNames: List<String>, keep: BooleanArray): ChainingBackend.Outputs {
        val n = inputs.size
        val data = arrayOfNulls<Any>(n)
        val dtypes = IntArray(n)
        val shapes = arrayOfNulls<LongArray>(n)
        val keptIndex = IntArray(n) { -1 }
        var from: MethodInput.Kept? = null
        for ((i, x) in inputs.withIndex()) when (x) {
            is MethodInput.Value -> { data[i] = x.tensor.data; dtypes[i] = x.tensor.dtype.code; shapes[i] = x.tensor.shape }
            is MethodInput.Kept -> {
                val f = from
                require(f == null || (f.method == x.method && f.generation == x.generation)) {
                    "$method input $i is kept from ${x.method} run ${x.generation}, another from ${f!!.method} run ${f.generation}: one run's outputs at a time"
                }
                from = x
                keptIndex[i] = x.index
            }
        }
        val out = synchronized(this) {
            nRun(live(), method, data, dtypes, shapes, keptIndex, from?.method, from?.generation ?: 0L, keep.takeIf { it.isNotEmpty() })
        }
        val generation = (out[0] as LongArray)[0]
        val count = (out.size - 1) / 2
        if (outputNames.isNotEmpty() && outputNames.size != count) {
            throw IllegalStateException("$method returned $count outputs, the manifest lists ${outputNames.size}: the program and manifest.json are of different exports")
        }
        val tensors = List(count) { i ->
            val desc = out[1 + 2 * i] as LongArray
            (out[2 + 2 * i] as ByteArray?)?.let { bytes ->
                val dtype = DType.fromCode(desc[0].toInt()) ?: throw IllegalStateException("$method output $i has dtype code ${desc[0]}")
                Tensor(dtype, desc.copyOfRange(1, desc.size), bytes)
            }
        }
        return ChainingBackend.Outputs(generation, tensors)
    }

    override fun close() {
        synchronized(this) {
            val h = handle
            handle = 0
            if (h != 0L) nClose(h)
        }
    }

    companion object {
        /**
         * Loads [program] with its external weights [weights] (null: none); [threads] sizes
         * ExecuTorch's process-wide thread pool (0: its default).
         */
        fun load(program: File, weights: File?, threads: Int = 0): ExecuTorchBackend {
            if (!program.isFile) throw IllegalArgumentException("no program at $program: push the export first")
            if (weights != null && !weights.isFile) throw IllegalArgumentException("no weights at $weights: the program's .ptd must be pushed beside it")
            EtLibrary.ensureLoaded(threads)
            return ExecuTorchBackend(nLoad(program.absolutePath, weights?.absolutePath), program)
        }
    }
}
