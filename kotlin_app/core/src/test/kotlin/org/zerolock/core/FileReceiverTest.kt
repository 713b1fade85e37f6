package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertFalse
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.FileReceiver
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.MsgType
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Tensor
import java.io.File
import java.io.FileOutputStream
import java.io.IOException
import java.security.MessageDigest

class FileReceiverTest {
    /** A part file on a disk with [room] bytes left: the write that does not fit fails as ENOSPC does. */
    private class FullDisk(file: File, private val room: Int) : FileOutputStream(file) {
        private var written = 0
        override fun write(b: ByteArray) {
            if (written + b.size > room) throw IOException("No space left on device")
            super.write(b); written += b.size
        }
    }

    private val data = ByteArray(5000) { (it * 13).toByte() }
    private val sha = Handshake.hex(MessageDigest.getInstance("SHA-256").digest(data))

    private fun push(rx: FileReceiver, id: Long): List<Message?> {
        val replies = mutableListOf(rx.onMessage(Message(MsgType.FILE_BEGIN, linkedMapOf(
            "transfer_id" to id, "name" to "chunk_0.ptd", "kind" to "weights", "size" to data.size, "sha256" to sha))))
        for (off in 0 until data.size step 1000) {
            replies += rx.onMessage(Message(MsgType.FILE_CHUNK, linkedMapOf("transfer_id" to id, "offset" to off),
                mapOf("data" to Tensor.ofBytes(data.copyOfRange(off, minOf(data.size, off + 1000))))))
        }
        replies += rx.onMessage(Message(MsgType.FILE_END, linkedMapOf("transfer_id" to id)))
        return replies
    }

    @Test
    fun `a full disk is named as such and nothing half-written stays`(@TempDir root: File) {
        val dir = File(root, "files")
        val replies = push(FileReceiver(dir) { FullDisk(it, room = 2500) }, 1)
        replies.dropLast(1).forEach { assertNull(it, "chunks are not answered; FILE_END reports the first failure") }
        val end = replies.last()!!
        assertEquals(false, end.bool("ok"))
        assertEquals("\"chunk_0.ptd\": writing it failed on the device after 2000 bytes (No space left on device); " +
            "make room in $dir and push it again", end.string("message"))
        assertEquals(emptyList<String>(), dir.list()!!.toList(), "the file is not there")
        assertEquals(emptyList<String>(), File(root, "files.incoming").list()!!.toList(), "nor its part file")
    }

    @Test
    fun `the same push lands where the disk has room`(@TempDir root: File) {
        val dir = File(root, "files")
        val end = push(FileReceiver(dir) { FullDisk(it, room = data.size) }, 2).last()!!
        assertEquals(true, end.bool("ok"), end.toString())
        assertTrue(File(dir, "chunk_0.ptd").readBytes().contentEquals(data))
        assertEquals(emptyList<String>(), File(root, "files.incoming").list()!!.toList())
    }

    @Test
    fun `a part file that cannot be created fails the transfer with the reason`(@TempDir root: File) {
        val dir = File(root, "files")
        val end = push(FileReceiver(dir) { throw IOException("Read-only file system") }, 3).last()!!
        assertEquals(false, end.bool("ok"))
        assertTrue(end.string("message").startsWith("\"chunk_0.ptd\": the device could not create it in $dir (Read-only file system)"), end.string("message"))
    }

    private fun begin(rx: FileReceiver, id: Long, name: String, bytes: ByteArray) = rx.onMessage(Message(MsgType.FILE_BEGIN, linkedMapOf(
        "transfer_id" to id, "name" to name, "kind" to "other", "size" to bytes.size,
        "sha256" to Handshake.hex(MessageDigest.getInstance("SHA-256").digest(bytes)))))

    private fun chunk(rx: FileReceiver, id: Long, bytes: ByteArray) =
        rx.onMessage(Message(MsgType.FILE_CHUNK, linkedMapOf("transfer_id" to id, "offset" to 0), mapOf("data" to Tensor.ofBytes(bytes))))

    private fun end(rx: FileReceiver, id: Long) = rx.onMessage(Message(MsgType.FILE_END, linkedMapOf("transfer_id" to id)))!!

    @Test
    fun `two uploads to one name cannot both succeed`(@TempDir root: File) {
        val dir = File(root, "files")
        val rx = FileReceiver(dir)
        val a = ByteArray(300) { 1 }
        val b = ByteArray(300) { 2 }
        assertNull(begin(rx, 1, "same.bin", a))
        assertNull(begin(rx, 2, "same.bin", b))
        assertNull(chunk(rx, 1, a), "chunks of the superseded transfer are dropped")
        assertNull(chunk(rx, 2, b))
        val ra = end(rx, 1)
        assertEquals(false, ra.bool("ok"))
        assertTrue(ra.string("message").contains("superseded by transfer 2"), ra.string("message"))
        assertEquals(true, end(rx, 2).bool("ok"))
        assertTrue(File(dir, "same.bin").readBytes().contentEquals(b))
    }

    @Test
    fun `abandoned transfers leave no open file and no part file`(@TempDir root: File) {
        val dir = File(root, "files")
        val rx = FileReceiver(dir)
        for (i in 0 until 300L) {
            begin(rx, i, "w${i % 3}.bin", data)
            chunk(rx, i, data.copyOfRange(0, 100))
            if (i % 50 == 49L) rx.abortAll() // the session ended
        }
        assertTrue(rx.openCount <= 3, "a new FILE_BEGIN for a name closes the one before: ${rx.openCount} open")
        rx.abortAll()
        assertEquals(0, rx.openCount)
        assertEquals(emptyList<String>(), File(root, "files.incoming").list()!!.toList())
        assertEquals(emptyList<String>(), dir.list()!!.toList())
    }

    @Test
    fun `open transfers are capped`(@TempDir root: File) {
        val rx = FileReceiver(File(root, "files"))
        for (i in 0 until 8L) assertNull(begin(rx, i, "cap$i.bin", data))
        val r = begin(rx, 8, "cap8.bin", data)!!
        assertEquals(false, r.bool("ok"))
        assertTrue(r.string("message").startsWith("8 transfers are already open"), r.string("message"))
        // its chunks are dropped and its FILE_END says why (it is not an unknown transfer)
        assertNull(chunk(rx, 8, data))
        assertTrue(end(rx, 8).string("message").startsWith("8 transfers are already open"))
    }

    /** PROTOCOL.md 5.1, as zl_mobile: a chunk or end of a transfer no FILE_BEGIN opened is UNEXPECTED
     *  without request_id (the session then ends), not a FILE_RESULT. */
    @Test
    fun `chunks and ends of no transfer are UNEXPECTED`(@TempDir root: File) {
        val rx = FileReceiver(File(root, "files"))
        for (m in listOf(Message(MsgType.FILE_END, linkedMapOf("transfer_id" to 987654321L)),
                         Message(MsgType.FILE_CHUNK, linkedMapOf("transfer_id" to 987654321L, "offset" to 0L), linkedMapOf("data" to Tensor.ofBytes(data))))) {
            val e = assertThrows<ProtocolException> { rx.onMessage(m) }
            assertEquals(ErrorCode.UNEXPECTED, e.code); assertNull(e.requestId)
        }
    }

    /** A FILE_BEGIN name 5.2 allows may hold CR, ESC, BEL: FILE_RESULT quotes it (tests/vectors/quoting.json). */
    @Test
    fun `a name with control characters is quoted in FILE_RESULT`(@TempDir root: File) {
        val rx = FileReceiver(File(root, "files"))
        val name = "a\nb\r\u001b[2J\u0007"
        begin(rx, 1, name, data)
        begin(rx, 2, name, data) // supersedes transfer 1
        val r = end(rx, 1)
        assertEquals(false, r.bool("ok"))
        assertTrue(r.string("message").startsWith("\"a\\nb\\r\\x1b[2J\\x07\": superseded"), r.string("message"))
        assertTrue(r.string("message").all { it.code in 0x20..0x7e }, r.string("message"))
    }

    @Test
    fun `file names of 251 to 255 bytes are stored`(@TempDir root: File) {
        val dir = File(root, "files")
        val rx = FileReceiver(dir)
        val names = listOf("n".repeat(251), "x".repeat(252), "y".repeat(253), "z".repeat(254), "q".repeat(255), "\u00e9".repeat(127) + "e")
        for ((i, name) in names.withIndex()) {
            assertEquals(true, name.toByteArray().size in 251..255)
            begin(rx, i.toLong(), name, data)
            chunk(rx, i.toLong(), data)
            val r = end(rx, i.toLong())
            assertEquals(true, r.bool("ok"), r.toString())
            assertTrue(File(dir, name).readBytes().contentEquals(data))
        }
    }
}
