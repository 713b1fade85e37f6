package org.zerolock.app

import org.pytorch.executorch.DType as EtDType
import org.pytorch.executorch.EValue
import org.pytorch.executorch.Module
import org.pytorch.executorch.Tensor as EtTensor
import org.zerolock.core.device.MethodBackend
import org.zerolock.core.protocol.DType
import org.zerolock.core.protocol.Tensor
import java.io.File
import java.nio.ByteBuffer
import java.nio.ByteOrder

/**
 * The one place that calls ExecuTorch: loads chunk_k.pte (+ its .ptd weights) from app storage
 * and runs the program's "phase1" / "phase2" methods. Everything else (input order by name,
 * LoRA, AdamW) lives in the core's ManifestChunkRunner.
 */
class ChunkProgram private constructor(private val module: Module) : MethodBackend {

    override fun run(method: String, inputs: List<Tensor>): List<Tensor> {
        val args = inputs.map { EValue.from(toEt(it)) }.toTypedArray()
        val outs = module.execute(method, *args)
        if (outs.isEmpty()) throw IllegalStateException("ExecuTorch returned no outputs for $method (module destroyed or method failed; see logcat tag ExecuTorch)")
        return outs.map { fromEt(it.toTensor()) }
    }

    override fun close() = module.destroy()

    companion object {
        /**
         * Load [program] with its external [weights] (.ptd). Module.load(path, mode) covers
         * programs with embedded weights; the overload that also takes the data file is looked up
         * reflectively because its signature is not the same across executorch-android releases
         * (1.0.x has none on Module; later releases add one).
         */
        fun load(program: File, weights: File?): ChunkProgram {
            if (weights == null) return ChunkProgram(Module.load(program.absolutePath, Module.LOAD_MODE_MMAP))
            val withData = Module::class.java.methods.firstOrNull { m ->
                m.name == "load" && java.lang.reflect.Modifier.isStatic(m.modifiers) &&
                    m.parameterTypes.size >= 2 && m.parameterTypes[0] == String::class.java && m.parameterTypes[1] == String::class.java
            } ?: throw IllegalStateException(
                "this executorch-android has no Module.load(program, data) overload, so ${weights.name} cannot be attached; " +
                    "update org.pytorch:executorch-android in app/build.gradle.kts to the release matching the exporter")
            val extra = withData.parameterTypes.drop(2).map { t -> if (t == Int::class.javaPrimitiveType) Module.LOAD_MODE_MMAP else null }
            val module = withData.invoke(null, program.absolutePath, weights.absolutePath, *extra.toTypedArray()) as Module
            return ChunkProgram(module)
        }

        private fun le(b: ByteArray): ByteBuffer = ByteBuffer.wrap(b).order(ByteOrder.LITTLE_ENDIAN)

        private fun toEt(t: Tensor): EtTensor = when (t.dtype) {
            DType.FLOAT32 -> EtTensor.fromBlob(t.toFloatArray(), t.shape)
            DType.FLOAT16, DType.BFLOAT16 -> EtTensor.fromBlob(t.toFloatArray(), t.shape) // widened; export in float32
            DType.INT64 -> EtTensor.fromBlob(t.toLongArray(), t.shape)
            DType.INT32 -> EtTensor.fromBlob(t.toLongArray().map { it.toInt() }.toIntArray(), t.shape)
            DType.UINT8 -> EtTensor.fromBlobUnsigned(t.data, t.shape)
            // bool masks travel as 0/1 bytes; the exporter takes masks as uint8/int64, not bool
            DType.BOOL -> EtTensor.fromBlobUnsigned(t.data, t.shape)
        }

        private fun fromEt(t: EtTensor): Tensor {
            val shape = t.shape()
            return when (t.dtype()) {
                EtDType.INT64 -> Tensor.ofLongs(t.dataAsLongArray, *shape)
                EtDType.INT32 -> Tensor.ofInts(t.dataAsIntArray, *shape)
                EtDType.UINT8 -> Tensor(DType.UINT8, shape, t.dataAsUnsignedByteArray)
                else -> Tensor.ofFloats(t.dataAsFloatArray, *shape)
            }
        }
    }
}
