package org.zerolock.core.device

import org.zerolock.core.Json
import org.zerolock.core.ProcStats
import org.zerolock.core.Safetensors
import org.zerolock.core.asObject
import org.zerolock.core.protocol.ErrorCode
import org.zerolock.core.protocol.Handshake
import org.zerolock.core.protocol.Schema
import org.zerolock.core.protocol.Quote
import org.zerolock.core.protocol.ProtocolException
import java.io.File
import java.security.MessageDigest

/**
 * Builds a [ManifestChunkRunner] for the assigned stage from what the host pushed into
 * [filesDir]: `manifest.json` (zl-export's), the chunk's program and its weights. The program's
 * SHA-256 must equal STAGE_ASSIGN's `program_sha256` (and the weights' `weights_sha256` when
 * given). [loadBackend] is the only platform-specific part (ExecuTorch on Android).
 */
class ManifestRunnerFactory(private val loadBackend: (program: File, weights: File?) -> MethodBackend) : RunnerFactory {
    override fun create(assignment: StageAssignment, filesDir: File): ChunkRunner {
        val mf = File(filesDir, "manifest.json")
        if (!mf.isFile) reject(assignment, "no manifest.json on the device; push the export (manifest, program, weights) first")
        val manifest = Json.parse(mf.readText()).asObject("manifest.json")
        @Suppress("UNCHECKED_CAST")
        val chunks = manifest["chunks"] as? List<Any?> ?: reject(assignment, "manifest.json has no 'chunks'")
        val chunk = chunks.map { it.asObject("chunk") }.firstOrNull { (it["index"] as? Number)?.toInt() == assignment.stage }
            ?: chunks.getOrNull(assignment.stage)?.asObject("chunk")
            ?: reject(assignment, "manifest.json has no chunk ${assignment.stage}")
        // PROTOCOL.md 5.2: the names first, before any file is looked at, so the answer never tells
        // whether a file outside the device's storage exists or what it holds (as zl_mobile)
        val listed = (manifest["files"] as? List<*>)?.mapNotNull { (it as? Map<*, *>)?.get("path") as? String }?.toSet()
        if (chunk["program"] == null) reject(assignment, "chunk ${assignment.stage} has no 'program'")
        for (key in listOf("program", "weights", "lora_init")) {
            val name = chunk[key] ?: continue
            if (name !is String || !Schema.isPlainFileName(name) || (listed != null && name !in listed)) {
                reject(assignment, "manifest.json names ${Quote.show(name)} as chunk ${assignment.stage}'s $key, which is not a plain " +
                    "file name listed in its files (no '/', '\\', '..'; files live in the phone's storage): push the export's own manifest.json")
            }
        }
        val program = File(filesDir, chunk["program"] as String)
        val weights = (chunk["weights"] as? String)?.let { File(filesDir, it) }
        if (!program.isFile) reject(assignment, "${program.name} was not pushed")
        if (sha256(program) != assignment.programSha256) reject(assignment, "${program.name} does not match program_sha256; re-push it")
        if (weights != null) {
            if (!weights.isFile) reject(assignment, "${weights.name} was not pushed")
            assignment.msg.stringOrNull("weights_sha256")?.let { if (sha256(weights) != it) reject(assignment, "${weights.name} does not match weights_sha256; re-push it") }
        }
        val export = manifest["export"] as? Map<*, *>
        val rows = export?.get("readout_rows")?.let {
            (it as? Number)?.toLong()?.takeIf { n -> n in 0..Int.MAX_VALUE }?.toInt()
                ?: reject(assignment, "manifest.json export.readout_rows must be a non-negative integer, got $it")
        }
        val alpha = export?.get("alpha")?.let {
            (it as? Number)?.toDouble()?.takeIf { a -> a in 0.0..1.0 }
                ?: reject(assignment, "manifest.json export.alpha must be a number from 0 to 1, got $it")
        }
        // as zl_mobile, the export's alpha is needed only when config.alpha does not override it;
        // refuse here rather than fail the first micro-batch on a missing program input
        if (alpha == null && assignment.alpha == null && ManifestChunkRunner.takesInput(chunk, "alpha")) {
            reject(assignment, "manifest.json has no export.alpha and STAGE_ASSIGN no config.alpha: the program needs its loss weight alpha")
        }
        val vocab = ((manifest["model"] as? Map<*, *>)?.get("config") as? Map<*, *>)?.get("vocab_size")?.let {
            (it as? Number)?.toLong()?.takeIf { v -> v > 0 } ?: reject(assignment, "manifest.json model.config.vocab_size must be a positive integer, got $it")
        }
        // the export's LoRA initialisation, as zl_mobile starts from it (the host pushes it)
        val loraInit = (chunk["lora_init"] as? String)?.let { rel ->
            val f = File(filesDir, rel)
            if (!f.isFile) reject(assignment, "${f.name} (the chunk's lora_init) was not pushed")
            try { Safetensors.readFloats(f) } catch (e: Safetensors.FormatError) { reject(assignment, e.message ?: "bad lora_init") }
        }
        ProcStats.SELF.runtimePssBytes() // before the first load: the memory breakdown's "runtime"
        return ManifestChunkRunner(chunk, loadBackend(program, weights), rows, alpha, vocab, loraInit)
    }

    private fun reject(a: StageAssignment, why: String): Nothing = throw ProtocolException(ErrorCode.REJECTED, why, a.msg.long("request_id"))

    companion object {
        fun sha256(f: File): String {
            val md = MessageDigest.getInstance("SHA-256")
            f.inputStream().use { s -> val buf = ByteArray(1 shl 20); while (true) { val n = s.read(buf); if (n < 0) break; md.update(buf, 0, n) } }
            return Handshake.hex(md.digest())
        }
    }
}
