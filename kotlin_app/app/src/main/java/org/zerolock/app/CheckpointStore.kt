package org.zerolock.app

import android.content.Context
import org.zerolock.core.protocol.Handshake
import java.io.File

/**
 * App-private storage: pushed programs/weights/manifest, stage checkpoints (written atomically
 * by the core's FileCheckpointStore), and the pairing token. Nothing here is world-readable.
 */
class CheckpointStore(context: Context) {
    private val root: File = context.filesDir
    val programsDir: File = File(root, "programs").apply { mkdirs() }
    val checkpointsDir: File = File(root, "checkpoints").apply { mkdirs() }
    private val tokenFile = File(root, "pairing_token")

    /** The pairing token (64 hex digits), created on first use. */
    @Synchronized
    fun token(): String {
        if (tokenFile.isFile) {
            val t = tokenFile.readText().trim()
            if (runCatching { Handshake.parseToken(t) }.isSuccess) return t
        }
        return newToken()
    }

    /** Replace the token: every host must be given the new one. */
    @Synchronized
    fun newToken(): String {
        val t = Handshake.newToken()
        val tmp = File(root, "pairing_token.tmp")
        tmp.writeText(t)
        if (!tmp.renameTo(tokenFile)) throw IllegalStateException("cannot write the pairing token")
        return t
    }

    /** Forget all checkpoints (a new run). */
    fun clearCheckpoints() {
        checkpointsDir.listFiles()?.forEach { it.delete() }
    }
}
