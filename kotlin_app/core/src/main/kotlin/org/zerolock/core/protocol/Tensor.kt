package org.zerolock.core.protocol

import java.nio.ByteBuffer
import java.nio.ByteOrder

/** Tensor dtypes of PROTOCOL.md 4.1. */
enum class DType(val code: Int, val wireName: String, val itemSize: Int) {
    FLOAT32(1, "float32", 4),
    FLOAT16(2, "float16", 2),
    BFLOAT16(3, "bfloat16", 2),
    INT64(4, "int64", 8),
    INT32(5, "int32", 4),
    UINT8(6, "uint8", 1),
    BOOL(7, "bool", 1);

    companion object {
        fun fromCode(code: Int): DType? = values().firstOrNull { it.code == code }
        fun fromName(name: String): DType? = values().firstOrNull { it.wireName == name }
    }
}

/**
 * A named tensor as carried on the wire: dtype, shape (u32 dims, row-major) and the raw
 * little-endian element bytes. Helpers convert to and from Kotlin arrays.
 */
class Tensor(val dtype: DType, shape: LongArray, val data: ByteArray) {
    val shape: LongArray = shape.copyOf()

    init {
        require(shape.size <= MAX_DIMS) { "at most $MAX_DIMS dims" }
        require(shape.all { it in 0..0xFFFF_FFFFL }) { "dims must be u32" }
        val n = elementCountOrNull(shape) ?: throw IllegalArgumentException("product of dims must be < 2^32")
        require(n * dtype.itemSize == data.size.toLong()) { "${data.size} bytes for shape ${shape.toList()} ${dtype.wireName}" }
        if (dtype == DType.BOOL) require(data.all { it == 0.toByte() || it == 1.toByte() }) { "bool bytes must be 0 or 1" }
    }

    val elementCount: Long get() = elementCountOrNull(shape)!!

    private fun le(): ByteBuffer = ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN)

    fun toFloatArray(): FloatArray = when (dtype) {
        DType.FLOAT32 -> FloatArray(data.size / 4).also { le().asFloatBuffer().get(it) }
        DType.BFLOAT16 -> { val b = le().asShortBuffer(); FloatArray(data.size / 2) { bf16ToFloat(b.get(it)) } }
        DType.FLOAT16 -> { val b = le().asShortBuffer(); FloatArray(data.size / 2) { f16ToFloat(b.get(it)) } }
        else -> throw IllegalStateException("tensor is ${dtype.wireName}, not a float type")
    }

    fun toLongArray(): LongArray = when (dtype) {
        DType.INT64 -> LongArray(data.size / 8).also { le().asLongBuffer().get(it) }
        DType.INT32 -> { val b = le().asIntBuffer(); LongArray(data.size / 4) { b.get(it).toLong() } }
        DType.UINT8, DType.BOOL -> LongArray(data.size) { (data[it].toInt() and 0xff).toLong() }
        else -> throw IllegalStateException("tensor is ${dtype.wireName}, not an integer type")
    }

    fun toBooleanArray(): BooleanArray {
        check(dtype == DType.BOOL) { "tensor is ${dtype.wireName}, not bool" }
        return BooleanArray(data.size) { data[it] != 0.toByte() }
    }

    override fun equals(other: Any?): Boolean =
        other is Tensor && other.dtype == dtype && other.shape.contentEquals(shape) && other.data.contentEquals(data)

    override fun hashCode(): Int = 31 * (31 * dtype.hashCode() + shape.contentHashCode()) + data.contentHashCode()
    override fun toString(): String = "Tensor(${dtype.wireName}, ${shape.toList()})"

    companion object {
        const val MAX_DIMS = 8

        /** element count, or null when the product of the non-zero dims is >= 2^32. */
        fun elementCountOrNull(shape: LongArray): Long? {
            var p = 1L
            var zero = false
            for (d in shape) {
                if (d == 0L) { zero = true; continue }
                p *= d
                if (p >= (1L shl 32)) return null
            }
            return if (zero) 0L else p
        }

        private fun buf(n: Int): ByteBuffer = ByteBuffer.allocate(n).order(ByteOrder.LITTLE_ENDIAN)

        fun ofFloats(values: FloatArray, vararg shape: Long): Tensor {
            val b = buf(values.size * 4); b.asFloatBuffer().put(values)
            return Tensor(DType.FLOAT32, if (shape.isEmpty()) longArrayOf(values.size.toLong()) else shape, b.array())
        }

        fun ofLongs(values: LongArray, vararg shape: Long): Tensor {
            val b = buf(values.size * 8); b.asLongBuffer().put(values)
            return Tensor(DType.INT64, if (shape.isEmpty()) longArrayOf(values.size.toLong()) else shape, b.array())
        }

        fun ofInts(values: IntArray, vararg shape: Long): Tensor {
            val b = buf(values.size * 4); b.asIntBuffer().put(values)
            return Tensor(DType.INT32, if (shape.isEmpty()) longArrayOf(values.size.toLong()) else shape, b.array())
        }

        fun ofBooleans(values: BooleanArray, vararg shape: Long): Tensor =
            Tensor(DType.BOOL, if (shape.isEmpty()) longArrayOf(values.size.toLong()) else shape,
                ByteArray(values.size) { if (values[it]) 1 else 0 })

        fun ofBytes(values: ByteArray): Tensor = Tensor(DType.UINT8, longArrayOf(values.size.toLong()), values.copyOf())

        /** bfloat16 = upper 16 bits of binary32; rounding to nearest even like torch. */
        fun ofBFloat16(values: FloatArray, vararg shape: Long): Tensor {
            val b = buf(values.size * 2)
            for (v in values) b.putShort(floatToBf16(v))
            return Tensor(DType.BFLOAT16, if (shape.isEmpty()) longArrayOf(values.size.toLong()) else shape, b.array())
        }

        fun bf16ToFloat(bits: Short): Float = java.lang.Float.intBitsToFloat((bits.toInt() and 0xffff) shl 16)

        fun floatToBf16(f: Float): Short {
            if (f.isNaN()) return 0x7fc0.toShort()
            val x = java.lang.Float.floatToRawIntBits(f)
            val rounding = 0x7fff + ((x ushr 16) and 1)
            return ((x + rounding) ushr 16).toShort()
        }

        /** IEEE binary16 -> binary32, exact (subnormals, inf, NaN included). */
        fun f16ToFloat(bits: Short): Float {
            val h = bits.toInt() and 0xffff
            val sign = if (h and 0x8000 != 0) -1f else 1f
            val exp = (h ushr 10) and 0x1f
            val mant = h and 0x3ff
            return when (exp) {
                0 -> sign * mant * Math.scalb(1f, -24)
                0x1f -> if (mant == 0) sign * Float.POSITIVE_INFINITY else Float.NaN
                else -> sign * (1f + mant / 1024f) * Math.scalb(1f, exp - 15)
            }
        }
    }
}
