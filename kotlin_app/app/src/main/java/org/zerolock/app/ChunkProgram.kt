package org.zerolock.app

import org.pytorch.executorch.DType as EtDType
import org.pytorch.executorch.EValue
import org.pytorch.executorch.Module
import org.pytorch.executorch.Tensor as EtTensor
import org.pytorch.executorch.training.TrainingModule
import org.zerolock.core.device.MethodBackend
import org.zerolock.core.protocol.DType
import org.zerolock.core.protocol.Tensor
import java.io.File

/**
 * The one place that calls ExecuTorch (org.pytorch:executorch-android 1.0.x): loads chunk_k.pte,
 * with its .ptd weights when the export has them, from app storage and runs the program's
 * "phase1" / "phase2" methods. Everything else (input order by name, LoRA, AdamW) lives in the
 * core's ManifestChunkRunner.
 *
 * Loading, as the executorch-android Java API allows it (see kotlin_app/README.md):
 * - a .pte with its weights inside: `Module.load(path, Module.LOAD_MODE_MMAP)`, then
 *   `Module.execute(method, inputs)`;
 * - a .pte plus a .ptd: `Module` has no data-file overload in any release (1.0.1 up to 1.4.x), the
 *   only loader that takes one is `TrainingModule.load(modelPath, dataPath)`, and it runs methods
 *   only through `executeForwardBackward(method, inputs)`, which returns the outputs before the
 *   gradients and needs the program's training metadata methods
 *   `__et_training_gradients_index_<m>`, `__et_training_parameters_index_<m>` and
 *   `__et_training_fqn_<m>`; the gradients come from `namedGradients(method)` by name.
 */
class ChunkProgram private constructor(
    private val module: Module?,
    private val training: TrainingModule?,
) : MethodBackend {

    override fun run(method: String, inputs: List<Tensor>, outputNames: List<String>): List<Tensor> {
        val args = inputs.map { EValue.from(toEt(it)) }.toTypedArray()
        if (module != null) {
            val outs = module.execute(method, *args)
            if (outs.isEmpty()) throw IllegalStateException("ExecuTorch returned no outputs for $method (module destroyed or method failed; see logcat tag ExecuTorch)")
            return outs.map { fromEt(it.toTensor()) }
        }
        val t = training!!
        val user = try {
            t.executeForwardBackward(method, *args)
        } catch (e: Exception) {
            throw IllegalStateException(
                "ExecuTorch could not run $method of a program with external weights (${e.message}); on Android such a program " +
                    "needs __et_training_gradients_index_$method, __et_training_parameters_index_$method and " +
                    "__et_training_fqn_$method (see kotlin_app/README.md), or export the weights inside the .pte", e)
        }.map { fromEt(it.toTensor()) }
        if (user.size >= outputNames.size) return user
        // the rest are gradients, by name: "grad:<lora name>" in the manifest, "<lora name>" in ExecuTorch
        val grads = t.namedGradients(method)
        return outputNames.mapIndexed { i, name ->
            if (i < user.size) user[i]
            else grads[name.removePrefix("grad:")]?.let { fromEt(it) }
                ?: throw IllegalStateException("$method: ExecuTorch returned no gradient for ${name.removePrefix("grad:")} (has ${grads.keys})")
        }
    }

    override fun close() {
        module?.destroy() // TrainingModule 1.0.x has no destroy(); its native side goes with the object
    }

    companion object {
        fun load(program: File, weights: File?): ChunkProgram =
            if (weights == null) ChunkProgram(Module.load(program.absolutePath, Module.LOAD_MODE_MMAP), null)
            else ChunkProgram(null, TrainingModule.load(program.absolutePath, weights.absolutePath))

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
