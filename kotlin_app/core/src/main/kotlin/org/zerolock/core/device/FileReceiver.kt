package org.zerolock.core.device

import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.ProtocolException
import org.zerolock.core.protocol.Quote
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Message
import org.zerolock.core.protocol.MsgType
import java.io.File
import java.io.FileOutputStream
import java.io.IOException
import java.nio.file.Files
import java.nio.file.StandardCopyOption
import java.security.MessageDigest

/**
 * Receives FILE_BEGIN / FILE_CHUNK / FILE_END (PROTOCOL.md 5.2) into [dir]: bytes go to a part
 * file of its own in [incoming] (short names: a 255-byte file name plus a suffix would pass
 * NAME_MAX, and two uploads to one name must never share a part file), are hashed on the way,
 * and on FILE_END a matching size + SHA-256 renames the file into place atomically. Returns the
 * FILE_RESULT to send (null for FILE_CHUNK on success). A failed write (a full disk) fails the
 * transfer with its reason, and the part file is removed; [open] is how a part file is opened
 * (a test passes one that fails like a full disk).
 *
 * A transfer the host abandons is closed and its part file removed: at [abortAll] (the session
 * ended), when a new FILE_BEGIN names the same file or reuses its id (the newest wins; the old
 * one's FILE_END gets ok=false saying why), or when it has seen no chunk for [staleAfterMs]
 * (counted from its last chunk, heartbeats or not: [sweep] runs on every session message), as
 * the zl_mobile device does. At most [maxOpen] transfers are open at once.
 */
class FileReceiver(
    private val dir: File,
    private val incoming: File = File(dir.absoluteFile.parentFile, dir.name + ".incoming"),
    private val maxOpen: Int = 8,
    private val staleAfterMs: Long = STALE_AFTER_MS,
    private val clockNs: () -> Long = System::nanoTime,
    private val open: (File) -> FileOutputStream = ::FileOutputStream,
) {
    constructor(dir: File, open: (File) -> FileOutputStream) : this(dir, File(dir.absoluteFile.parentFile, dir.name + ".incoming"), 8, open = open)

    private class Transfer(val name: String, val size: Long, val sha256: String, val part: File, val out: FileOutputStream?) {
        val digest: MessageDigest = MessageDigest.getInstance("SHA-256")
        var received = 0L
        var failed: String? = null
        var seenNs = 0L
    }

    companion object {
        /** PROTOCOL.md 5.2: an open transfer with no chunk for this long is abandoned. */
        const val STALE_AFTER_MS = 120_000L
    }

    /** Abandon the transfers that have seen no chunk for [staleAfterMs]. */
    fun sweep() {
        val now = clockNs()
        for ((id, t) in transfers.entries.toList()) {
            if (now - t.seenNs > staleAfterMs * 1_000_000) {
                abandon(id, "${Quote.quote(t.name)}: no chunk for ${staleAfterMs / 1000.0} s, the transfer was dropped")
            }
        }
    }

    private val transfers = HashMap<Long, Transfer>()
    private val gone = object : LinkedHashMap<Long, String>() { // abandoned id -> why, for its FILE_END
        override fun removeEldestEntry(eldest: MutableMap.MutableEntry<Long, String>?) = size > 64
    }

    init { // part files of an earlier process (killed mid-push) are never finished
        incoming.listFiles()?.forEach { it.delete() }
    }

    /** Transfers open now (tests: nothing is left open after abandoning). */
    val openCount: Int get() = transfers.size

    private fun result(id: Long, ok: Boolean, size: Long, sha: String?, message: String? = null): Message {
        val m = linkedMapOf<String, Any?>("transfer_id" to id, "ok" to ok, "size" to size, "sha256" to sha)
        if (message != null) m["message"] = message
        return Message(MsgType.FILE_RESULT, m)
    }

    fun onMessage(m: Message): Message? {
        sweep()
        return when (m.type) {
            MsgType.FILE_BEGIN -> begin(m)
            MsgType.FILE_CHUNK -> chunk(m)
            MsgType.FILE_END -> end(m)
            else -> throw IllegalArgumentException("not a file transfer message: ${m.type}")
        }
    }

    private fun abandon(id: Long, why: String) {
        transfers.remove(id)?.let { discard(it) }
        gone[id] = why
    }

    private fun begin(m: Message): Message? {
        val id = m.long("transfer_id")
        val name = m.string("name") // validated as a plain file name by the schema
        if (transfers.containsKey(id)) abandon(id, "transfer $id was restarted by a new FILE_BEGIN with the same id")
        for ((other, t) in transfers.entries.toList()) {
            if (t.name == name) abandon(other, "${Quote.quote(name)}: superseded by transfer $id to the same name; only the last FILE_BEGIN for a name is kept")
        }
        gone.remove(id)
        if (transfers.size >= maxOpen) { // refused at once: its chunks are dropped, its FILE_END says why
            val why = "$maxOpen transfers are already open on this device; finish (FILE_END) one before starting another"
            gone[id] = why
            return result(id, false, 0, null, why)
        }
        dir.mkdirs()
        incoming.mkdirs()
        val part = File(incoming, "$id-${System.nanoTime().toString(36)}.part")
        var why: String? = null
        val out = try { open(part) } catch (e: IOException) { why = e.message; null }
        val t = Transfer(name, m.long("size"), m.string("sha256"), part, out).also { it.seenNs = clockNs() }
        if (out == null) t.failed = "${Quote.quote(name)}: the device could not create it in $dir ($why); make room there (or check its permissions) and push it again"
        transfers[id] = t
        return null
    }
    private fun discard(t: Transfer) {
        try { t.out?.close() } catch (_: IOException) {}
        t.part.delete()
    }

    private fun writeFailed(t: Transfer, e: IOException) =
        "${Quote.quote(t.name)}: writing it failed on the device after ${t.received} bytes (${e.message}); make room in $dir and push it again"

    private fun chunk(m: Message): Message? {
        val id = m.long("transfer_id")
        val t = transfers[id] ?: return if (gone.containsKey(id)) null // abandoned: its FILE_END says why
            else throw unknown("FILE_CHUNK for unknown transfer $id; send FILE_BEGIN first")
        t.seenNs = clockNs()
        if (t.failed != null) return null
        val data = m.tensor("data").data
        val off = m.long("offset")
        when {
            off != t.received -> t.failed = "chunk at offset $off, expected ${t.received} (gap or overlap)"
            t.received + data.size > t.size -> t.failed = "chunks exceed the announced size ${t.size}"
            else -> try {
                t.out!!.write(data); t.digest.update(data); t.received += data.size
            } catch (e: IOException) { // a full disk: say so, not the offset mismatch every later chunk would cause
                t.failed = writeFailed(t, e)
                discard(t)
            }
        }
        return null
    }

    private fun end(m: Message): Message {
        val id = m.long("transfer_id")
        val t = transfers.remove(id) ?: return result(id, false, 0, null,
            gone.remove(id)?.let { "$it; push it again" } ?: throw unknown("FILE_END for unknown transfer $id"))
        if (t.failed == null) {
            try { t.out!!.flush(); t.out.fd.sync(); t.out.close() } catch (e: IOException) { t.failed = writeFailed(t, e) }
        }
        val sha = Handshake.hex(t.digest.digest())
        val why = t.failed
            ?: if (t.received != t.size) "received ${t.received} of ${t.size} bytes" else null
            ?: if (sha != t.sha256) "sha256 mismatch (got $sha); re-push the file" else null
        if (why != null) {
            discard(t)
            return result(id, false, t.received, sha, why)
        }
        Files.move(t.part.toPath(), File(dir, t.name).toPath(), StandardCopyOption.ATOMIC_MOVE, StandardCopyOption.REPLACE_EXISTING)
        return result(id, true, t.received, sha)
    }

    /** A chunk or end of no transfer this session began: about no request, so the session ends (PROTOCOL.md 5.1, as zl_mobile). */
    private fun unknown(why: String) = ProtocolException(ErrorCode.UNEXPECTED, why)

    fun abortAll() {
        for (t in transfers.values) discard(t)
        transfers.clear()
        gone.clear()
    }
}
