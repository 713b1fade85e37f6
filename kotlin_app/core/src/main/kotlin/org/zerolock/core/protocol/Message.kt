package org.zerolock.core.protocol

/** Message types of PROTOCOL.md section 5. */
enum class MsgType(val code: Int) {
    AUTH_REQUEST(0x01), AUTH_CHALLENGE(0x02), AUTH_RESPONSE(0x03), AUTH_OK(0x04), HELLO(0x05),
    HEARTBEAT(0x06), ACK(0x07), ERROR(0x08), SHUTDOWN(0x09),
    FILE_BEGIN(0x10), FILE_CHUNK(0x11), FILE_END(0x12), FILE_RESULT(0x13),
    STAGE_ASSIGN(0x20),
    HIDDEN_STATE(0x30), GRADIENT(0x31), CREDIT(0x32), REPLAY_REQUEST(0x33),
    TELEMETRY(0x40), CHECKPOINT_COMMITTED(0x41),
    STATE_GET(0x50), STATE_PUT(0x51);

    companion object {
        private val byCode = values().associateBy { it.code }
        fun fromCode(code: Int): MsgType? = byCode[code]
    }
}

/** One protocol message: type, metadata (JSON object) and named tensors (wire order kept). */
class Message(
    val type: MsgType,
    meta: Map<String, Any?> = emptyMap(),
    tensors: Map<String, Tensor> = emptyMap(),
) {
    /** Metadata with Kotlin Int/Short/Byte widened to Long and Float to Double (JSON values). */
    val meta: LinkedHashMap<String, Any?> = LinkedHashMap<String, Any?>().also { m -> for ((k, v) in meta) m[k] = normalize(v) }
    val tensors: LinkedHashMap<String, Tensor> = LinkedHashMap(tensors)

    fun long(key: String): Long = meta[key] as? Long ?: throw IllegalStateException("$type has no integer '$key'")
    fun longOrNull(key: String): Long? = meta[key] as? Long
    fun string(key: String): String = meta[key] as? String ?: throw IllegalStateException("$type has no string '$key'")
    fun stringOrNull(key: String): String? = meta[key] as? String
    fun bool(key: String): Boolean = meta[key] as? Boolean ?: throw IllegalStateException("$type has no bool '$key'")
    fun tensor(name: String): Tensor = tensors[name] ?: throw IllegalStateException("$type has no tensor '$name'")

    private companion object {
        fun normalize(v: Any?): Any? = when (v) {
            is Int -> v.toLong(); is Short -> v.toLong(); is Byte -> v.toLong(); is Float -> v.toDouble()
            is Map<*, *> -> LinkedHashMap<String, Any?>().also { m -> for ((k, x) in v) m[k as String] = normalize(x) }
            is Iterable<*> -> v.map { normalize(it) }
            is Array<*> -> v.map { normalize(it) }
            else -> v
        }
    }

    override fun toString(): String = "$type$meta${if (tensors.isEmpty()) "" else tensors.keys.toString()}"
}

/** Schema of PROTOCOL.md section 5, checked on decode (violations -> MALFORMED) and on encode. */
object Schema {
    private enum class T { UINT, INT, STR, BOOL, HEX64, HEX64_OR_NULL, STR_OR_NULL, LIST_STR, OBJECT, NUMBER }
    private enum class Tensors { NONE, ANY, AT_LEAST_ONE, REQUIRE_H, FILE_DATA }

    private class Spec(val req: Map<String, T>, val opt: Map<String, T>, val tensors: Tensors, val extra: (Message) -> Unit = {})

    private val HEX64 = Regex("^[0-9a-f]{64}$")
    val FILE_KINDS = setOf("program", "weights", "manifest", "other")
    val STATE_KINDS = setOf("lora", "optimizer")

    private val specs: Map<MsgType, Spec> = mapOf(
        // the X25519 shares of version 2 are optional here so a version-1 AUTH_REQUEST decodes and gets BAD_VERSION
        MsgType.AUTH_REQUEST to Spec(mapOf("protocol_version" to T.UINT, "host_nonce" to T.HEX64, "host_name" to T.STR), mapOf("host_share" to T.HEX64), Tensors.NONE),
        MsgType.AUTH_CHALLENGE to Spec(mapOf("device_nonce" to T.HEX64, "device_name" to T.STR), mapOf("device_share" to T.HEX64), Tensors.NONE),
        MsgType.AUTH_RESPONSE to Spec(mapOf("host_proof" to T.HEX64), emptyMap(), Tensors.NONE),
        MsgType.AUTH_OK to Spec(mapOf("device_proof" to T.HEX64), emptyMap(), Tensors.NONE),
        MsgType.HELLO to Spec(
            mapOf("name" to T.STR, "protocol_version" to T.UINT, "runtime_version" to T.STR, "memory_bytes" to T.UINT, "capabilities" to T.LIST_STR),
            mapOf("model" to T.STR, "os" to T.STR, "abi" to T.STR, "cores" to T.UINT, "memory_budget_bytes" to T.UINT, "cpu_share" to T.NUMBER), Tensors.NONE),
        MsgType.HEARTBEAT to Spec(mapOf("seq" to T.UINT), mapOf("time_ms" to T.UINT, "busy_ms" to T.UINT), Tensors.NONE),
        MsgType.ACK to Spec(mapOf("request_id" to T.UINT, "ok" to T.BOOL), mapOf("message" to T.STR), Tensors.NONE),
        MsgType.ERROR to Spec(mapOf("code" to T.STR, "message" to T.STR), mapOf("request_id" to T.UINT), Tensors.NONE),
        MsgType.SHUTDOWN to Spec(emptyMap(), mapOf("reason" to T.STR), Tensors.NONE),
        MsgType.FILE_BEGIN to Spec(
            mapOf("transfer_id" to T.UINT, "name" to T.STR, "kind" to T.STR, "size" to T.UINT, "sha256" to T.HEX64), emptyMap(), Tensors.NONE
        ) { m ->
            checkFileName(m.string("name"))
            if (m.string("kind") !in FILE_KINDS) malformed("FILE_BEGIN kind must be one of $FILE_KINDS")
        },
        MsgType.FILE_CHUNK to Spec(mapOf("transfer_id" to T.UINT, "offset" to T.UINT), emptyMap(), Tensors.FILE_DATA),
        MsgType.FILE_END to Spec(mapOf("transfer_id" to T.UINT), emptyMap(), Tensors.NONE),
        MsgType.FILE_RESULT to Spec(
            mapOf("transfer_id" to T.UINT, "ok" to T.BOOL, "size" to T.UINT, "sha256" to T.HEX64_OR_NULL), mapOf("message" to T.STR), Tensors.NONE),
        MsgType.STAGE_ASSIGN to Spec(
            mapOf("request_id" to T.UINT, "stage" to T.UINT, "num_stages" to T.UINT, "upstream" to T.STR_OR_NULL,
                "downstream" to T.STR_OR_NULL, "program_sha256" to T.HEX64),
            mapOf("weights_sha256" to T.HEX64, "window_size" to T.UINT, "buffer_capacity" to T.UINT, "inflight_depth" to T.UINT,
                "replay_horizon" to T.UINT, "schedule" to T.STR, "run_id" to T.STR, "listen_port" to T.UINT,
                "upstream_token" to T.HEX64, "downstream_token" to T.HEX64, "config" to T.OBJECT),
            Tensors.NONE,
        ) { m -> if (m.long("stage") >= m.long("num_stages")) malformed("STAGE_ASSIGN stage ${m.long("stage")} is not < num_stages ${m.long("num_stages")}") },
        MsgType.HIDDEN_STATE to Spec(mapOf("micro_batch" to T.UINT, "window" to T.UINT), emptyMap(), Tensors.REQUIRE_H),
        MsgType.GRADIENT to Spec(mapOf("micro_batch" to T.UINT), mapOf("window" to T.UINT), Tensors.AT_LEAST_ONE),
        MsgType.CREDIT to Spec(mapOf("credits" to T.UINT), mapOf("micro_batch" to T.UINT), Tensors.NONE) { m ->
            if (m.long("credits") < 1) malformed("CREDIT credits must be >= 1")
        },
        MsgType.REPLAY_REQUEST to Spec(mapOf("from_micro_batch" to T.UINT, "to_micro_batch" to T.UINT), mapOf("window" to T.UINT), Tensors.NONE) { m ->
            if (m.long("from_micro_batch") > m.long("to_micro_batch")) malformed("REPLAY_REQUEST from_micro_batch > to_micro_batch")
        },
        MsgType.TELEMETRY to Spec(
            emptyMap(),
            mapOf("kind" to T.STR, "stage" to T.UINT, "step" to T.UINT, "window" to T.UINT, "micro_batch" to T.UINT, "loss" to T.NUMBER,
                "task_loss" to T.NUMBER, "consis_loss" to T.NUMBER, "pss_bytes" to T.UINT, "rss_peak_bytes" to T.UINT,
                "temperature_c" to T.NUMBER, "active_s" to T.NUMBER, "wait_s" to T.NUMBER, "wait_downstream_s" to T.NUMBER,
                "replay_held" to T.UINT, "replay_held_peak" to T.UINT, "bytes_in" to T.UINT, "bytes_out" to T.UINT,
                "cpu_s" to T.NUMBER, "time_ms" to T.UINT, "nonfinite" to T.LIST_STR),
            Tensors.NONE),
        MsgType.CHECKPOINT_COMMITTED to Spec(mapOf("window" to T.UINT, "step" to T.UINT, "sha256" to T.HEX64), emptyMap(), Tensors.NONE),
        MsgType.STATE_GET to Spec(mapOf("request_id" to T.UINT, "kind" to T.STR), emptyMap(), Tensors.NONE) { m -> checkStateKind(m) },
        MsgType.STATE_PUT to Spec(mapOf("request_id" to T.UINT, "kind" to T.STR), mapOf("window" to T.UINT, "step" to T.UINT), Tensors.ANY) { m -> checkStateKind(m) },
    )

    private fun checkStateKind(m: Message) {
        if (m.string("kind") !in STATE_KINDS) malformed("${m.type} kind must be one of $STATE_KINDS")
    }

    fun checkFileName(name: String) {
        if (!isPlainFileName(name)) malformed("file name ${Quote.quote(name)} must be a plain name of 1..255 bytes without '/', '\\' or NUL")
    }

    /** PROTOCOL.md 5.2: a plain file name (FILE_BEGIN's, and every file a manifest names), never a path. */
    fun isPlainFileName(name: String): Boolean {
        val n = name.toByteArray(Charsets.UTF_8).size
        return n in 1..255 && name != "." && name != ".." && name.none { it == '/' || it == '\\' || it == '\u0000' }
    }

    private fun typeOk(v: Any?, t: T): Boolean = when (t) {
        T.UINT -> v is Long && v >= 0
        T.INT -> v is Long
        T.STR -> v is String
        T.BOOL -> v is Boolean
        T.HEX64 -> v is String && HEX64.matches(v)
        T.HEX64_OR_NULL -> v == null || (v is String && HEX64.matches(v))
        T.STR_OR_NULL -> v == null || v is String
        T.LIST_STR -> v is List<*> && v.all { it is String }
        T.OBJECT -> v is Map<*, *>
        T.NUMBER -> v is Long || v is Double
    }

    /** Throw MALFORMED unless [m] obeys its type's schema. */
    fun validate(m: Message) {
        val spec = specs[m.type] ?: throw ProtocolException(ErrorCode.UNKNOWN_TYPE, "no schema for ${m.type}")
        for ((k, t) in spec.req) {
            if (!m.meta.containsKey(k)) malformed("${m.type} lacks required field '$k'")
            if (!typeOk(m.meta[k], t)) malformed("${m.type} field '$k' must be ${t.name.lowercase()}, got ${Quote.show(m.meta[k])}")
        }
        for ((k, t) in spec.opt) {
            if (m.meta.containsKey(k) && !typeOk(m.meta[k], t)) malformed("${m.type} field '$k' must be ${t.name.lowercase()}, got ${Quote.show(m.meta[k])}")
        }
        when (spec.tensors) {
            Tensors.NONE -> if (m.tensors.isNotEmpty()) malformed("${m.type} carries no tensors, got ${m.tensors.size}")
            Tensors.ANY -> {}
            Tensors.AT_LEAST_ONE -> if (m.tensors.isEmpty()) malformed("${m.type} needs at least one tensor")
            Tensors.REQUIRE_H -> if ("h" !in m.tensors) malformed("${m.type} lacks tensor 'h'")
            Tensors.FILE_DATA -> {
                val d = m.tensors["data"]
                if (m.tensors.size != 1 || d == null || d.dtype != DType.UINT8 || d.shape.size != 1) {
                    malformed("FILE_CHUNK needs exactly one tensor 'data', uint8, ndim 1")
                }
            }
        }
        spec.extra(m)
    }
}

/** Builders for the messages a device and a host send. */
object Messages {
    /** [fatal]: PROTOCOL.md 5.4.1, an ERROR from a stage's own runtime the run cannot go on after. */
    fun error(code: ErrorCode, message: String, requestId: Long? = null, fatal: Boolean? = null): Message {
        val meta = linkedMapOf<String, Any?>("code" to code.name, "message" to message.replace('\n', ' '))
        if (requestId != null) meta["request_id"] = requestId
        if (fatal != null) meta["fatal"] = fatal
        return Message(MsgType.ERROR, meta)
    }

    fun ack(requestId: Long, ok: Boolean = true, message: String? = null): Message {
        val meta = linkedMapOf<String, Any?>("request_id" to requestId, "ok" to ok)
        if (message != null) meta["message"] = message
        return Message(MsgType.ACK, meta)
    }

    fun heartbeat(seq: Long, timeMs: Long? = null): Message =
        Message(MsgType.HEARTBEAT, linkedMapOf<String, Any?>("seq" to seq).also { if (timeMs != null) it["time_ms"] = timeMs })

    fun hiddenState(microBatch: Long, window: Long, h: Tensor, others: Map<String, Tensor> = emptyMap()): Message =
        Message(MsgType.HIDDEN_STATE, linkedMapOf("micro_batch" to microBatch, "window" to window), linkedMapOf("h" to h).also { it.putAll(others) })

    fun credit(credits: Long, microBatch: Long? = null): Message =
        Message(MsgType.CREDIT, linkedMapOf<String, Any?>("credits" to credits).also { if (microBatch != null) it["micro_batch"] = microBatch })

    fun hello(name: String, runtimeVersion: String, memoryBytes: Long, capabilities: List<String>, extra: Map<String, Any?> = emptyMap()): Message =
        Message(MsgType.HELLO, LinkedHashMap<String, Any?>(extra).also {
            it["name"] = name; it["protocol_version"] = Frames.PROTOCOL_VERSION.toLong(); it["runtime_version"] = runtimeVersion
            it["memory_bytes"] = memoryBytes; it["capabilities"] = capabilities
        })
}
