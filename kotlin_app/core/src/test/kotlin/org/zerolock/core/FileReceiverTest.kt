package org.zerolock.core

import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertFalse
import org.junit.jupiter.api.Assertions.assertNull
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import org.junit.jupiter.api.io.TempDir
import org.zerolock.core.device.FileReceiver
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.MsgType
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
    fun `a full disk is named as such and nothing half-written stays`(@TempDir dir: File) {
        val replies = push(FileReceiver(dir) { FullDisk(it, room = 2500) }, 1)
        replies.dropLast(1).forEach { assertNull(it, "chunks are not answered; FILE_END reports the first failure") }
        val end = replies.last()!!
        assertEquals(false, end.bool("ok"))
        assertEquals("chunk_0.ptd: writing it failed on the device after 2000 bytes (No space left on device); " +
            "make room in $dir and push it again", end.string("message"))
        assertEquals(emptyList<String>(), dir.list()!!.toList(), "neither the file nor its .part is left")
    }

    @Test
    fun `the same push lands where the disk has room`(@TempDir dir: File) {
        val end = push(FileReceiver(dir) { FullDisk(it, room = data.size) }, 2).last()!!
        assertEquals(true, end.bool("ok"), end.toString())
        assertTrue(File(dir, "chunk_0.ptd").readBytes().contentEquals(data))
        assertFalse(File(dir, "chunk_0.ptd.part").exists())
    }

    @Test
    fun `a part file that cannot be created fails the transfer with the reason`(@TempDir dir: File) {
        val end = push(FileReceiver(dir) { throw IOException("Read-only file system") }, 3).last()!!
        assertEquals(false, end.bool("ok"))
        assertTrue(end.string("message").startsWith("chunk_0.ptd: the device could not create it in $dir (Read-only file system)"), end.string("message"))
    }
}
