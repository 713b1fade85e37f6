package org.zerolock.core

import java.io.File
import java.nio.ByteBuffer
import java.nio.ByteOrder
import org.zerolock.core.protocol.DType
import org.zerolock.core.protocol.Tensor

/**
 * Reads tensors from a safetensors file (8-byte little-endian header length, a JSON
 * header of name -> dtype / shape / data_offsets, then the data): the export's `lora_init`, so a
 * Kotlin stage starts from the same LoRA as a zl_mobile one.
 */
object Safetensors {
    class FormatError(msg: String) : IllegalArgumentException(msg)

    private val DTYPES = mapOf("F32" to DType.FLOAT32, "F16" to DType.FLOAT16, "BF16" to DType.BFLOAT16, "I64" to DType.INT64,
        "I32" to DType.INT32, "U8" to DType.UINT8, "BOOL" to DType.BOOL)

    /** Float32 tensors by name (a tensor of another dtype is an error). */
    fun readFloats(file: File): Map<String, FloatArray> = read(file).mapValues { (name, t) ->
        if (t.dtype != DType.FLOAT32) throw FormatError("${file.name}: $name is ${t.dtype.wireName}, not float32")
        t.toFloatArray()
    }

    /** Every tensor by name, in the header's order. */
    fun read(file: File): Map<String, Tensor> {
        val bytes = file.readBytes()
        fun bad(why: String): Nothing = throw FormatError("${file.name} is not a safetensors file of float32 tensors: $why")
        if (bytes.size < 8) bad("shorter than its header length")
        val n = ByteBuffer.wrap(bytes, 0, 8).order(ByteOrder.LITTLE_ENDIAN).long
        if (n < 2 || n > bytes.size - 8L) bad("header length $n does not fit ${bytes.size} bytes")
        val header = try { Json.parse(String(bytes, 8, n.toInt(), Charsets.UTF_8)).asObject("header") } catch (e: Json.JsonError) { bad("header: ${e.message}") }
        val base = 8 + n.toInt()
        val out = LinkedHashMap<String, Tensor>()
        for ((name, v) in header) {
            if (name == "__metadata__") continue
            val e = v as? Map<*, *> ?: bad("entry $name is not an object")
            val dtype = DTYPES[e["dtype"]] ?: bad("$name has dtype ${e["dtype"]}")
            val shape = (e["shape"] as? List<*>)?.map { (it as? Number)?.toLong() ?: bad("$name shape") }?.toLongArray() ?: bad("$name lacks a shape")
            val offs = (e["data_offsets"] as? List<*>)?.map { (it as? Number)?.toLong() ?: bad("$name data_offsets") } ?: bad("$name lacks data_offsets")
            if (offs.size != 2 || offs[0] < 0 || offs[1] < offs[0] || base + offs[1] > bytes.size || (offs[1] - offs[0]) != (Tensor.elementCountOrNull(shape) ?: -1L) * dtype.itemSize) bad("$name data_offsets $offs do not fit ${dtype.wireName} ${shape.toList()}")
            out[name] = Tensor(dtype, shape, bytes.copyOfRange(base + offs[0].toInt(), base + offs[1].toInt()))
        }
        return out
    }
}
