// The workspace's event stream over a websocket (PROTOCOL §5), with commands on the same socket
// and automatic reconnection.
//
// Reconnection: after the socket closes, the next attempt waits BACKOFF_BASE_MS, doubling per
// failed attempt up to BACKOFF_MAX_MS, with jitter (so many tabs do not reconnect in step). An
// attempt that got its `hello` frame resets the backoff. Before each attempt `prepare()` runs (the
// page re-opens the workspace there, which also renews its hold) and returns the URL to connect
// to, including `since=<last seq>` so the server replays what was missed.
//
// Commands: `command(method, params)` sends `{"id", "method", "params"}` and resolves with the
// reply's `result` (or rejects with an ApiError carrying the reply's status). Replies travel in
// the same ordered stream as events, so a snapshot read by command is never older than an event
// received before its reply. Commands pending when the socket closes are rejected with status 0.

import { ApiError, BASE } from "./api.js";
import { sleep } from "./dom.js";

/** First reconnect delay (milliseconds). */
export const BACKOFF_BASE_MS = 250;
/** Longest reconnect delay (milliseconds). */
export const BACKOFF_MAX_MS = 10000;
/** Bound on waiting for a command's reply (milliseconds). */
export const COMMAND_TIMEOUT_MS = 30000;
/** Bound on the opening handshake up to the `hello` frame (milliseconds). */
export const HELLO_TIMEOUT_MS = 10000;

/** Delay before reconnect attempt number `attempt` (1-based), with jitter in [0.5, 1]. */
export function backoffDelay(attempt) {
  const base = Math.min(BACKOFF_BASE_MS * 2 ** Math.max(0, attempt - 1), BACKOFF_MAX_MS);
  return Math.round(base * (0.5 + Math.random() / 2));
}

export class EventStream {
  /**
   * @param {object} handlers
   * @param {() => Promise<string>} handlers.prepare the URL (path and query) to connect to; may
   *   throw an ApiError (401 stops reconnecting).
   * @param {(frame: object) => void} handlers.onFrame every frame except command replies.
   * @param {(state: string, detail?: object) => void} handlers.onState "connecting", "open",
   *   "reconnecting" ({delay, attempt, reason}), "unauthorized" ({message}) or "closed".
   */
  constructor({ prepare, onFrame, onState }) {
    this.prepare = prepare;
    this.onFrame = onFrame;
    this.onState = onState;
    this.socket = null;
    this.open = false;
    this.stopped = true;
    this.nextId = 1;
    this.pending = new Map();
    this.wake = null;
  }

  /** Start connecting (and reconnecting) until `stop()`. */
  start() {
    if (!this.stopped) return;
    this.stopped = false;
    this.loop();
  }

  /** Close the socket and stop reconnecting. */
  stop() {
    this.stopped = true;
    this.wake?.abort();
    if (this.socket) this.socket.close(1000, "client closed");
    this.onState("closed");
  }

  /** Skip the current backoff wait. */
  reconnectNow() {
    this.wake?.abort();
  }

  async loop() {
    let attempt = 0;
    while (!this.stopped) {
      this.onState(attempt === 0 ? "connecting" : "reconnecting", { attempt, delay: 0 });
      let reason = "";
      try {
        const url = await this.prepare();
        if (this.stopped) break;
        const greeted = await this.connect(url);
        reason = greeted.reason;
        if (greeted.ok) attempt = 0;
      } catch (err) {
        if (err instanceof ApiError && err.status === 401) {
          this.stopped = true;
          this.onState("unauthorized", { message: err.message });
          return;
        }
        reason = err.message || String(err);
      }
      if (this.stopped) break;
      attempt += 1;
      const delay = backoffDelay(attempt);
      this.onState("reconnecting", { attempt, delay, reason });
      this.wake = new AbortController();
      await sleep(delay, this.wake.signal);
      this.wake = null;
    }
  }

  /** One connection; resolves when it closes, with whether it got its `hello`. */
  connect(path) {
    return new Promise((resolve) => {
      const scheme = location.protocol === "https:" ? "wss:" : "ws:";
      const socket = new WebSocket(`${scheme}//${location.host}${BASE}${path}`);
      this.socket = socket;
      let greeted = false;
      const helloTimer = setTimeout(() => {
        if (!greeted) socket.close(4000, "no hello");
      }, HELLO_TIMEOUT_MS);
      const handle = (frame) => {
        if (frame === null || typeof frame !== "object") return;
        if (frame.type === "reply") {
          this.settle(frame);
          return;
        }
        if (frame.type === "hello" && !greeted) {
          greeted = true;
          this.open = true;
          clearTimeout(helloTimer);
          this.onFrame(frame);
          this.onState("open");
          return;
        }
        this.onFrame(frame);
      };
      socket.addEventListener("message", (ev) => {
        // batch=1: a frame may carry several envelopes, one per line, in order (docs/protocol.md
        // §6.1); compact JSON holds no raw newline.
        for (const line of String(ev.data).split("\n")) {
          if (!line) continue;
          let frame;
          try {
            frame = JSON.parse(line);
          } catch {
            continue;
          }
          handle(frame);
        }
      });
      socket.addEventListener("close", (ev) => {
        clearTimeout(helloTimer);
        this.open = false;
        if (this.socket === socket) this.socket = null;
        for (const [id, waiter] of this.pending) {
          clearTimeout(waiter.timer);
          waiter.reject(new ApiError(0, "the connection closed before the reply"));
          this.pending.delete(id);
        }
        const why = ev.code === 1006 ? "connection lost" : `closed (${ev.code}${ev.reason ? `: ${ev.reason}` : ""})`;
        resolve({ ok: greeted, reason: why });
      });
    });
  }

  settle(frame) {
    const waiter = this.pending.get(frame.id);
    if (!waiter) return;
    this.pending.delete(frame.id);
    clearTimeout(waiter.timer);
    if (frame.ok) waiter.resolve(frame.result);
    else waiter.reject(new ApiError(frame.status || 500, frame.message || "command failed"));
  }

  /**
   * Send a command over the socket.
   * @returns {Promise<any>} the reply's result
   */
  command(method, params = {}) {
    if (!this.open || !this.socket) {
      return Promise.reject(new ApiError(0, "not connected"));
    }
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      const timer = setTimeout(() => {
        this.pending.delete(id);
        reject(new ApiError(0, `no reply to ${method} within ${COMMAND_TIMEOUT_MS / 1000}s`));
      }, COMMAND_TIMEOUT_MS);
      this.pending.set(id, { resolve, reject, timer });
      this.socket.send(JSON.stringify({ id, method, params }));
    });
  }
}
