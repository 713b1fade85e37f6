package org.zerolock.core

import java.io.ByteArrayOutputStream
import java.io.DataInputStream
import java.io.DataOutputStream
import java.io.File
import java.io.FileOutputStream
import java.io.IOException
import java.nio.channels.FileChannel
import java.nio.file.AtomicMoveNotSupportedException
import java.nio.file.Files
import java.nio.file.StandardCopyOption
import java.nio.file.StandardOpenOption
import java.util.zip.CRC32

/** A stage checkpoint: LoRA values + AdamW moments per tensor, optimizer step, last window. */
class Checkpoint(
    val lastCommittedWindow: Long,
    val optimizerSteps: Long,
    val tensors: LinkedHashMap<String, Tensor>,
) {
    class Tensor(val param: FloatArray, val expAvg: FloatArray, val expAvgSq: FloatArray) {
        init { require(param.size == expAvg.size && param.size == expAvgSq.size) }
    }

    fun encode(): ByteArray {
        val bos = ByteArrayOutputStream()
        val out = DataOutputStream(bos)
        out.writeInt(MAGIC)
        out.writeInt(VERSION)
        out.writeLong(lastCommittedWindow)
        out.writeLong(optimizerSteps)
        out.writeInt(tensors.size)
        for ((name, t) in tensors) {
            out.writeUTF(name)
            out.writeInt(t.param.size)
            for (a in arrayOf(t.param, t.expAvg, t.expAvgSq)) for (x in a) out.writeFloat(x)
        }
        out.flush()
        val body = bos.toByteArray()
        val crc = CRC32().also { it.update(body) }.value
        return body + java.nio.ByteBuffer.allocate(8).putLong(crc).array()
    }

    companion object {
        const val MAGIC = 0x5A4C434B // "ZLCK"
        const val VERSION = 1

        fun decode(bytes: ByteArray): Checkpoint {
            if (bytes.size < 8 + 28) throw IOException("checkpoint too short (${bytes.size} bytes)")
            val body = bytes.copyOfRange(0, bytes.size - 8)
            val crc = java.nio.ByteBuffer.wrap(bytes, bytes.size - 8, 8).long
            if (CRC32().also { it.update(body) }.value != crc) throw IOException("checkpoint CRC mismatch")
            val inp = DataInputStream(body.inputStream())
            if (inp.readInt() != MAGIC) throw IOException("not a ZeroLock checkpoint")
            val v = inp.readInt()
            if (v != VERSION) throw IOException("unsupported checkpoint version $v")
            val window = inp.readLong()
            val steps = inp.readLong()
            val n = inp.readInt()
            val tensors = LinkedHashMap<String, Tensor>()
            repeat(n) {
                val name = inp.readUTF()
                val len = inp.readInt()
                if (len < 0 || len.toLong() * 12 > body.size) throw IOException("bad tensor length $len")
                val arrs = Array(3) { FloatArray(len) { inp.readFloat() } }
                tensors[name] = Tensor(arrs[0], arrs[1], arrs[2])
            }
            return Checkpoint(window, steps, tensors)
        }
    }
}

/** Where a stage's checkpoint lives. [commit] must be durable and atomic when it returns. */
interface CheckpointStoreApi {
    fun load(): Checkpoint?
    fun commit(checkpoint: Checkpoint)
}

/**
 * Checkpoint in one file, written atomically: bytes to `<name>.tmp`, flush + fsync, atomic
 * rename over `<name>`, fsync of the directory. A crash at any point leaves either the previous
 * or the new checkpoint, never a torn one. [faults] lets tests crash between the steps.
 */
class FileCheckpointStore(val file: File, private val faults: (Point) -> Unit = {}) : CheckpointStoreApi {
    enum class Point { BEFORE_WRITE, AFTER_TEMP_SYNCED, AFTER_RENAME }

    private val tmp: File get() = File(file.parentFile, file.name + ".tmp")

    override fun load(): Checkpoint? {
        if (tmp.exists()) tmp.delete() // a leftover of a crash before the rename: never committed
        if (!file.exists()) return null
        return Checkpoint.decode(file.readBytes())
    }

    override fun commit(checkpoint: Checkpoint) {
        val bytes = checkpoint.encode()
        file.parentFile?.mkdirs()
        faults(Point.BEFORE_WRITE)
        FileOutputStream(tmp).use { out ->
            out.write(bytes)
            out.flush()
            out.fd.sync()
        }
        faults(Point.AFTER_TEMP_SYNCED)
        try {
            Files.move(tmp.toPath(), file.toPath(), StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING)
        } catch (e: AtomicMoveNotSupportedException) {
            throw IOException("filesystem of ${file.parent} cannot rename atomically", e)
        }
        syncDirectory(file.absoluteFile.parentFile)
        faults(Point.AFTER_RENAME)
    }

    /**
     * Fault injection (mid-checkpoint): cut the checkpoint being written in half, as a crash
     * mid-write leaves it; [load] must then never read it. Returns what it did, or null (no temp file).
     */
    fun tearPending(): String? {
        if (!tmp.isFile) return null
        java.io.RandomAccessFile(tmp, "rw").use { f ->
            val size = f.length()
            f.setLength(maxOf(1L, size / 2))
            return "left a half-written checkpoint ${tmp.name} (${f.length()} of $size bytes)"
        }
    }

    private fun syncDirectory(dir: File) {
        // Makes the rename itself durable on Linux/Android; not possible on every platform.
        try {
            FileChannel.open(dir.toPath(), StandardOpenOption.READ).use { it.force(true) }
        } catch (_: IOException) {
        } catch (_: UnsupportedOperationException) {
        }
    }
}

/** In-memory store for tests and dry runs. */
class MemoryCheckpointStore : CheckpointStoreApi {
    private var bytes: ByteArray? = null
    override fun load(): Checkpoint? = bytes?.let { Checkpoint.decode(it) }
    override fun commit(checkpoint: Checkpoint) { bytes = checkpoint.encode() }
}
