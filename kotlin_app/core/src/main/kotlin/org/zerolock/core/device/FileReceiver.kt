package org.zerolock.core.device

import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.MsgType
import java.io.File
import java.io.FileOutputStream
import java.nio.file.Files
import java.nio.file.StandardCopyOption
import java.security.MessageDigest

/**
 * Receives FILE_BEGIN / FILE_CHUNK / FILE_END (PROTOCOL.md 5.2) into [dir]: bytes go to
 * `<name>.part`, are hashed on the way, and on FILE_END a matching size + SHA-256 renames the
 * file into place atomically. Returns the FILE_RESULT to send (null for FILE_CHUNK on success).
 */
class FileReceiver(private val dir: File) {
    private class Transfer(val name: String, val size: Long, val sha256: String, val part: File, val out: FileOutputStream) {
        val digest: MessageDigest = MessageDigest.getInstance("SHA-256")
        var received = 0L
        var failed: String? = null
    }

    private val transfers = HashMap<Long, Transfer>()

    private fun result(id: Long, ok: Boolean, size: Long, sha: String?, message: String? = null): Message {
        val m = linkedMapOf<String, Any?>("transfer_id" to id, "ok" to ok, "size" to size, "sha256" to sha)
        if (message != null) m["message"] = message
        return Message(MsgType.FILE_RESULT, m)
    }

    fun onMessage(m: Message): Message? = when (m.type) {
        MsgType.FILE_BEGIN -> begin(m)
        MsgType.FILE_CHUNK -> chunk(m)
        MsgType.FILE_END -> end(m)
        else -> throw IllegalArgumentException("not a file transfer message: ${m.type}")
    }

    private fun begin(m: Message): Message? {
        val id = m.long("transfer_id")
        transfers.remove(id)?.let { it.out.close(); it.part.delete() }
        dir.mkdirs()
        val name = m.string("name") // validated as a plain file name by the schema
        val part = File(dir, "$name.part")
        transfers[id] = Transfer(name, m.long("size"), m.string("sha256"), part, FileOutputStream(part))
        return null
    }

    private fun chunk(m: Message): Message? {
        val id = m.long("transfer_id")
        val t = transfers[id] ?: return result(id, false, 0, null, "no FILE_BEGIN for transfer $id; start the transfer again")
        if (t.failed != null) return null
        val data = m.tensor("data").data
        val off = m.long("offset")
        when {
            off != t.received -> t.failed = "chunk at offset $off, expected ${t.received} (gap or overlap)"
            t.received + data.size > t.size -> t.failed = "chunks exceed the announced size ${t.size}"
            else -> { t.out.write(data); t.digest.update(data); t.received += data.size }
        }
        return null
    }

    private fun end(m: Message): Message {
        val id = m.long("transfer_id")
        val t = transfers.remove(id) ?: return result(id, false, 0, null, "no FILE_BEGIN for transfer $id; start the transfer again")
        t.out.flush(); t.out.fd.sync(); t.out.close()
        val sha = Handshake.hex(t.digest.digest())
        val why = t.failed
            ?: if (t.received != t.size) "received ${t.received} of ${t.size} bytes" else null
            ?: if (sha != t.sha256) "sha256 mismatch (got $sha); re-push the file" else null
        if (why != null) {
            t.part.delete()
            return result(id, false, t.received, sha, why)
        }
        Files.move(t.part.toPath(), File(dir, t.name).toPath(), StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING)
        return result(id, true, t.received, sha)
    }

    fun abortAll() {
        for (t in transfers.values) { try { t.out.close() } catch (_: Exception) {}; t.part.delete() }
        transfers.clear()
    }
}
