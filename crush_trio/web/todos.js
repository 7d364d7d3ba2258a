// The session's todo list (the `todos` tool): a checklist under the session head.
//
// The list arrives with the Session object (`todos`: [{content, status, active_form}]), from
// `sessions.list` and from every `session` event, so it updates live at every client; the page
// only has to render the current session's list whenever the session changes. Text goes in
// through textContent (dom.js), so the model's words never become markup.

import { clear, h } from "./dom.js";

const STATUS_LABELS = { pending: "to do", in_progress: "in progress", completed: "done" };
const STATUS_MARKS = { pending: "○", in_progress: "◐", completed: "●" };

/** The checklist element, made once and placed in the side panel (else after the session head). */
function container() {
  let el = document.getElementById("todos");
  if (el) return el;
  el = h("section", { id: "todos", class: "todos", "aria-label": "Plan", hidden: true });
  const panel = document.getElementById("panel-plan");
  const head = document.querySelector(".session-head");
  if (panel) panel.append(el);
  else if (head) head.after(el);
  else document.getElementById("main")?.prepend(el);
  return el;
}

/**
 * Show `session`'s todo list (or hide the checklist when it has none).
 * @param {{todos?: Array<{content: string, status: string, active_form?: string}>}|null|undefined} session
 */
export function renderTodos(session) {
  const el = container();
  const todos = Array.isArray(session?.todos) ? session.todos : [];
  const key = JSON.stringify(todos);
  if (el.dataset.key === key) return; // nothing changed: keep focus and scroll as they are
  el.dataset.key = key;
  clear(el);
  el.hidden = todos.length === 0;
  if (!todos.length) return;
  const done = todos.filter((t) => t.status === "completed").length;
  const list = h("ol", { class: "todo-list" });
  for (const todo of todos) {
    const status = STATUS_LABELS[todo.status] ? todo.status : "pending";
    const text = status === "in_progress" && todo.active_form ? todo.active_form : todo.content;
    list.append(
      h(
        "li",
        { class: "todo", dataset: { status } },
        h("span", { class: "todo-mark", "aria-hidden": "true", text: STATUS_MARKS[status] }),
        h("span", { class: "todo-text", text }),
        h("span", { class: "visually-hidden", text: ` (${STATUS_LABELS[status]})` }),
      ),
    );
  }
  el.append(
    h(
      "details",
      { open: true },
      h("summary", {}, h("span", { class: "todo-title", text: "Plan" }), ` ${done} of ${todos.length} done`),
      list,
    ),
  );
}
