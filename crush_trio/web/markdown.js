// A small, safe Markdown renderer: text in, DOM nodes out.
//
// It never builds HTML strings: every node is made with createElement and every piece of text
// goes in as a Text node, so model output such as "<script>" is shown as the characters it is.
// Raw HTML in the source is not interpreted (it stays visible text). Links are kept only for
// http:, https: and mailto: targets, and open in a new tab without a referrer.
//
// Supported: ATX headings, paragraphs (single newlines become line breaks), fenced code blocks
// (``` or ~~~, an unterminated fence while streaming is still a code block), indented lists
// (ordered, unordered, task boxes, nested by indentation), block quotes, horizontal rules, GFM
// tables, and inline code, **strong**, *emphasis*, ~~strike~~, [links](url), <autolinks> and
// backslash escapes.

import { h } from "./dom.js";

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)?.*$/;
const HEADING = /^ {0,3}(#{1,6})(?:\s+(.*?))?\s*#*\s*$/;
const HR = /^ {0,3}([-*_])(?:\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const LIST_ITEM = /^( *)([-*+]|\d{1,9}[.)])(?:\s+(.*))?$/;
const TABLE_SEP = /^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$/;
const SAFE_URL = /^(https?:\/\/|mailto:)/i;

/**
 * How the top-level blocks are laid out in the element (the same for a full render and for a
 * stream, at every moment):
 *
 *     div.md-final > div.md-run > (the final blocks, RUN_BLOCKS per run)
 *     (the open blocks)
 *
 * where div.md-final is there once a block is final.
 *
 * A block is *final* once the lines that decided its end are complete (followed by a newline):
 * more text can no longer change it. The blocks from the first one that is not final on are
 * *open*. A streaming reply changes only its open blocks, which are direct children of the
 * element, next to a single `div.md-final`: the browser's layout after an append covers the open
 * blocks and a few siblings, not the final ones (measured: appending to a paragraph after 3,000
 * blocks in runs of 64 costs ~0.2 ms of layout, after one `div.md-final` ~0.13 ms, flat). Final
 * blocks are grouped in runs so that adding one lays out one run and the list of runs, not every
 * block (with 4,000 sibling blocks each append cost ~20 ms of layout). A full run (`md-full`) has
 * `content-visibility: auto` (app.css), so that runs off screen cost nothing per append.
 */
export const RUN_BLOCKS = 64;

/**
 * Lines of a code block per `span.code-lines` (a block box): a code block still being written
 * grows in its last span, so an append makes the browser lay out at most this many lines rather
 * than the whole block (measured: an append to one text node of 1,000 lines costs ~3 ms of
 * layout, to a span of at most 32 lines ~0.15 ms). Every span but the last ends with the newline
 * that ends its last line, so the block's text is exactly the code, also when copied.
 */
export const CODE_CHUNK_LINES = 32;

/**
 * Render Markdown source into a DocumentFragment.
 * @param {string} source
 * @returns {DocumentFragment}
 */
export function renderMarkdown(source) {
  const frag = document.createDocumentFragment();
  const final = h("div", { class: "md-final" });
  const lines = String(source ?? "").replace(/\r\n?/g, "\n").split("\n");
  let run = null;
  let open = false;
  for (let b = nextBlock(lines, 0); b; b = nextBlock(lines, b.end)) {
    open = open || !isFinal(b.end, lines);
    if (open) frag.append(b.node);
    else run = appendBlock(final, run, b.node);
  }
  if (final.firstChild) frag.prepend(final);
  return frag;
}

/**
 * Whether a block that ends at line `end` (`nextBlock`'s `end`) of `lines` is final: the lines
 * that decided its end, up to `end + 1`, are complete, i.e. not the last (incomplete) line.
 */
function isFinal(end, lines) {
  return end + 1 <= lines.length - 2;
}

/**
 * Append a top-level block to `run`, or to a new run when it is full; returns the run used. A
 * run that is full is marked `md-full`: it never changes again, and the stylesheet lets the
 * browser skip it while it is off screen.
 */
function appendBlock(parent, run, node) {
  if (!run || run.childNodes.length >= RUN_BLOCKS) {
    run = h("div", { class: "md-run" });
    parent.append(run);
  }
  run.append(node);
  if (run.childNodes.length === RUN_BLOCKS) run.className = "md-run md-full";
  return run;
}

function isBlank(line) {
  return line.trim() === "";
}

function startsBlock(lines, i) {
  const line = lines[i];
  return (
    FENCE.test(line) ||
    HEADING.test(line) ||
    HR.test(line) ||
    QUOTE.test(line) ||
    LIST_ITEM.test(line) ||
    isTableStart(lines, i)
  );
}

function isTableStart(lines, i) {
  return (
    i + 1 < lines.length &&
    lines[i].includes("|") &&
    TABLE_SEP.test(lines[i + 1]) &&
    lines[i + 1].includes("-")
  );
}

/** Parse a list of lines into block nodes. */
function parseBlocks(lines) {
  const out = [];
  for (let b = nextBlock(lines, 0); b; b = nextBlock(lines, b.end)) out.push(b.node);
  return out;
}

/**
 * The block that starts at or after line `i` (blank lines are skipped), as `{node, end}` where
 * `end` is the index of the first line it did not consume, or null when only blank lines are
 * left. Deciding where a block ends reads at most the lines up to `end + 1` (a paragraph asks
 * whether its next line starts a table, which needs the line after); nothing reads lines before
 * `i`. The incremental renderer (MarkdownStream) relies on both facts.
 */
function nextBlock(lines, i) {
  while (i < lines.length && isBlank(lines[i])) i++;
  if (i >= lines.length) return null;
  const line = lines[i];
  let m;
  if ((m = FENCE.exec(line))) {
    const marker = m[1];
    const lang = (m[2] || "").replace(/[^\w+#.-]/g, "");
    const body = [];
    i++;
    while (i < lines.length && !lines[i].trimStart().startsWith(marker)) {
      body.push(lines[i]);
      i++;
    }
    i++; // the closing fence (or past the end while the block is still streaming)
    return { node: codeBlock(body.join("\n"), lang), end: i };
  }
  if ((m = HEADING.exec(line)) && /^ {0,3}#{1,6}(\s|$)/.test(line)) {
    const level = m[1].length;
    return { node: h(`h${Math.min(level + 2, 6)}`, { class: `md-h md-h${level}` }, inline(m[2] || "")), end: i + 1 };
  }
  if (HR.test(line)) return { node: h("hr"), end: i + 1 };
  if (QUOTE.test(line)) {
    const body = [];
    while (i < lines.length && !isBlank(lines[i]) && (m = QUOTE.exec(lines[i]))) {
      body.push(m[1]);
      i++;
    }
    return { node: h("blockquote", {}, parseBlocks(body)), end: i };
  }
  if (LIST_ITEM.test(line)) {
    const [node, end] = parseList(lines, i);
    return { node, end };
  }
  if (isTableStart(lines, i)) {
    const [node, end] = parseTable(lines, i);
    return { node, end };
  }
  const para = [line.trim()];
  i++;
  while (i < lines.length && !isBlank(lines[i]) && !startsBlock(lines, i)) {
    para.push(lines[i].trim());
    i++;
  }
  return { node: h("p", {}, inlineLines(para)), end: i };
}

function codeBlock(text, lang) {
  const code = h("code", lang ? { class: `language-${lang}` } : {});
  const lines = text.split("\n");
  for (let k = 0; k < lines.length; k += CODE_CHUNK_LINES) {
    const more = k + CODE_CHUNK_LINES < lines.length;
    const chunk = lines.slice(k, k + CODE_CHUNK_LINES).join("\n") + (more ? "\n" : "");
    code.append(h("span", { class: "code-lines", text: chunk }));
  }
  const wrapper = h("div", { class: "code-block" });
  if (lang) wrapper.append(h("span", { class: "code-lang", text: lang }));
  wrapper.append(h("pre", { tabindex: "0" }, code));
  return wrapper;
}

function parseList(lines, start) {
  const first = LIST_ITEM.exec(lines[start]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const list = h(ordered ? "ol" : "ul");
  if (ordered) {
    const n = parseInt(first[2], 10);
    if (n !== 1) list.setAttribute("start", String(n));
  }
  let i = start;
  while (i < lines.length) {
    const m = LIST_ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const contentIndent = indent + m[2].length + 1;
    const body = [m[3] || ""];
    i++;
    // Continuation: indented lines (nested blocks) and lazy paragraph lines.
    while (i < lines.length) {
      const line = lines[i];
      if (isBlank(line)) {
        const next = lines[i + 1];
        if (next !== undefined && !isBlank(next) && leadingSpaces(next) >= contentIndent) {
          body.push("");
          i++;
          continue;
        }
        break;
      }
      const sub = LIST_ITEM.exec(line);
      if (sub && sub[1].length <= indent) break;
      if (leadingSpaces(line) >= Math.min(contentIndent, indent + 2)) {
        body.push(line.slice(Math.min(leadingSpaces(line), contentIndent)));
      } else if (!startsBlock(lines, i)) {
        body.push(line.trim());
      } else break;
      i++;
    }
    list.append(listItem(body));
    // A blank line between items of the same list keeps the list going.
    if (i < lines.length && isBlank(lines[i])) {
      const next = LIST_ITEM.exec(lines[i + 1] ?? "");
      if (next && next[1].length === indent && /\d/.test(next[2]) === ordered) i++;
    }
  }
  return [list, i];
}

function listItem(body) {
  const li = h("li");
  let text = body;
  const task = /^\[([ xX])\]\s+/.exec(body[0]);
  if (task) {
    li.className = "task";
    li.append(h("input", { type: "checkbox", disabled: true, checked: task[1] !== " ", "aria-label": task[1] !== " " ? "done" : "not done" }));
    text = [body[0].slice(task[0].length), ...body.slice(1)];
  }
  const simple = text.every((l) => !isBlank(l)) && !text.some((l, k) => k > 0 && startsBlock(text, k));
  if (simple) li.append(...inlineLines(text.map((l) => l.trim())));
  else li.append(...parseBlocks(text));
  return li;
}

function leadingSpaces(line) {
  return line.length - line.trimStart().length;
}

function splitRow(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  const cells = [];
  let cur = "";
  for (let k = 0; k < s.length; k++) {
    if (s[k] === "\\" && s[k + 1] === "|") {
      cur += "|";
      k++;
    } else if (s[k] === "|") {
      cells.push(cur.trim());
      cur = "";
    } else cur += s[k];
  }
  cells.push(cur.trim());
  return cells;
}

function parseTable(lines, start) {
  const head = splitRow(lines[start]);
  const aligns = splitRow(lines[start + 1]).map((c) =>
    c.startsWith(":") && c.endsWith(":") ? "center" : c.endsWith(":") ? "right" : c.startsWith(":") ? "left" : "",
  );
  const cell = (tag, text, k) => {
    const el = h(tag, {}, inline(text));
    if (aligns[k]) el.dataset.align = aligns[k];
    return el;
  };
  const thead = h("thead", {}, h("tr", {}, head.map((c, k) => cell("th", c, k))));
  const tbody = h("tbody");
  let i = start + 2;
  while (i < lines.length && !isBlank(lines[i]) && lines[i].includes("|")) {
    const row = splitRow(lines[i]);
    tbody.append(h("tr", {}, head.map((_, k) => cell("td", row[k] ?? "", k))));
    i++;
  }
  return [h("div", { class: "table-wrap" }, h("table", {}, thead, tbody)), i];
}

/** Inline content of several lines joined by line breaks. */
function inlineLines(lines) {
  const out = [];
  lines.forEach((line, k) => {
    if (k > 0) out.push(h("br"));
    out.push(...inline(line));
  });
  return out;
}

const INLINE = [
  { re: /\\([\\`*_{}\[\]()#+\-.!|~<>])/y, make: (m) => [document.createTextNode(m[1])] },
  {
    re: /(`+)([\s\S]*?[^`])\1(?!`)/y,
    make: (m) => {
      const code = h("code");
      code.textContent = m[2].length > 2 && m[2].startsWith(" ") && m[2].endsWith(" ") ? m[2].slice(1, -1) : m[2];
      return [code];
    },
  },
  { re: /\*\*(?=\S)([\s\S]*?\S)\*\*/y, make: (m) => [h("strong", {}, inline(m[1]))] },
  { re: /__(?=\S)([\s\S]*?\S)__(?!\w)/y, make: (m) => [h("strong", {}, inline(m[1]))] },
  { re: /~~(?=\S)([\s\S]*?\S)~~/y, make: (m) => [h("del", {}, inline(m[1]))] },
  { re: /\*(?=[^\s*])([\s\S]*?[^\s*])\*/y, make: (m) => [h("em", {}, inline(m[1]))] },
  { re: /_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/y, make: (m) => [h("em", {}, inline(m[1]))] },
  {
    // [text](url "title"): the url may hold one level of balanced parentheses.
    re: /\[([^\]\n]*)\]\(\s*<?((?:[^()\s<>]|\([^()\s]*\))*)>?(?:\s+"[^"]*")?\s*\)/y,
    make: (m) => link(m[1], m[2]),
  },
  { re: /<((?:https?:\/\/|mailto:)[^\s<>]+)>/y, make: (m) => link(m[1], m[1]) },
];

function link(text, url) {
  if (!SAFE_URL.test(url)) return [...inline(text)];
  return [
    h("a", { href: url, target: "_blank", rel: "noopener noreferrer nofollow" }, text ? inline(text) : url),
  ];
}

/**
 * Parse inline Markdown into nodes.
 * @param {string} text
 * @returns {Node[]}
 */
export function inline(text) {
  const out = [];
  let plain = "";
  let i = 0;
  const flush = () => {
    if (plain) out.push(document.createTextNode(plain));
    plain = "";
  };
  // An emphasis marker at a word boundary only: snake_case_names stay as they are.
  outer: while (i < text.length) {
    const ch = text[i];
    if ("\\`*_~[<".includes(ch) && !(ch === "_" && /\w/.test(text[i - 1] ?? ""))) {
      for (const rule of INLINE) {
        rule.re.lastIndex = i;
        const m = rule.re.exec(text);
        if (m) {
          flush();
          out.push(...rule.make(m));
          i = rule.re.lastIndex;
          continue outer;
        }
      }
    }
    plain += ch;
    i++;
  }
  flush();
  return out;
}

/**
 * Markdown that grows by appends (a streaming reply), rendered into `el` at the cost of what
 * changed rather than of the whole text.
 *
 * The nodes of blocks that can no longer change stay as they are; each render parses only the
 * text after them and replaces the nodes of the blocks that may still change (the last one or
 * two). A block is final once every line that decided where it ends is complete, i.e. followed
 * by a newline: by `nextBlock`'s contract those are the lines up to its `end + 1`, and parsing
 * never looks back, so the text after a final block parses exactly as it does inside the whole
 * text. The element therefore always holds what `renderMarkdown` makes of the whole text.
 */
export class MarkdownStream {
  /** @param {HTMLElement} [el] the element the blocks go into (emptied first) */
  constructor(el) {
    this.el = el || h("div");
    this.reset();
  }

  /** Forget what was shown and empty the element. */
  reset() {
    /** The container of the final blocks' runs (in the element once a block is final). */
    this.final = h("div", { class: "md-final" });
    this.el.replaceChildren();
    /** The raw text shown. */
    this.source = "";
    /** The text after the final blocks, line endings normalized. */
    this.tail = "";
    /** Whether `source` ends with "\r" (a "\n" that comes next belongs to it). */
    this.cr = false;
    /** The nodes of the blocks that may still change. */
    this.open = [];
    /** When the text after the final blocks is one unterminated code fence: how to extend it. */
    this.fence = null;
  }

  /**
   * Show `text`. When it extends the text shown (the usual case for a streaming message, whether
   * the page got the append or a whole new snapshot), only the appended part is rendered;
   * anything else is rendered anew.
   * @param {string} text
   * @param {{from: string, text: string}} [hint] `text` is `hint.from + hint.text`: when
   *   `hint.from` is the text shown (usually the very same string, compared in O(1)), the
   *   append is rendered without comparing the whole text.
   */
  set(text, hint) {
    const next = String(text ?? "");
    const old = this.source;
    if (next.length === old.length && next === old) return;
    if (hint && hint.from === old) {
      this.append(hint.text);
    } else if (next.length > old.length && next.startsWith(old)) {
      this.append(next.slice(old.length));
    } else {
      this.reset();
      this.append(next);
    }
    // The caller's string: the next hint's `from` is that very string.
    this.source = next;
  }

  /** Append raw text and render what it changed. */
  append(raw) {
    if (!raw) return;
    this.source += raw;
    // Line endings are normalized like renderMarkdown's: "\r\n" and a lone "\r" are one "\n",
    // also when the "\r" and the "\n" arrive in different appends.
    const chunk = this.cr && raw[0] === "\n" ? raw.slice(1) : raw;
    this.cr = raw.endsWith("\r");
    const text = chunk.replace(/\r\n?/g, "\n");
    this.tail += text;
    if (!this.extendFence(text)) this.render();
  }

  /**
   * The common long open block, a code fence still being written, grows by appending to the
   * text of its last span of lines (a new span after every CODE_CHUNK_LINES lines, as
   * `codeBlock` splits them) as long as no line of the new text closes it. Returns whether it
   * did.
   */
  extendFence(text) {
    const fence = this.fence;
    if (!fence) return false;
    const lines = this.tail.slice(fence.lineStart).split("\n");
    if (lines.some((line) => line.trimStart().startsWith(fence.marker))) {
      this.fence = null;
      return false;
    }
    let rest = text;
    while (rest) {
      // The last span takes newlines until it holds CODE_CHUNK_LINES lines: the newline that
      // ends its last line is its own, and the text after it starts a new span.
      let at = -1;
      for (let n = fence.newlines; n < CODE_CHUNK_LINES; n++) {
        at = rest.indexOf("\n", at + 1);
        if (at < 0) break;
      }
      const piece = at < 0 ? rest : rest.slice(0, at + 1);
      if (fence.chunk.firstChild) fence.chunk.firstChild.appendData(piece);
      else fence.chunk.textContent = piece;
      if (at < 0) {
        fence.newlines += countNewlines(piece);
        break;
      }
      fence.chunk = h("span", { class: "code-lines", text: "" });
      fence.code.append(fence.chunk);
      fence.newlines = 0;
      rest = rest.slice(at + 1);
    }
    fence.lineStart = this.tail.lastIndexOf("\n") + 1;
    return true;
  }

  render() {
    this.fence = null;
    for (const node of this.open) node.remove();
    this.open = [];
    let run = this.final.lastChild;
    const lines = this.tail.split("\n");
    let done = 0;
    let end = 0;
    for (let b = nextBlock(lines, 0); b; b = nextBlock(lines, b.end)) {
      end = b.end;
      if (this.open.length === 0 && isFinal(b.end, lines)) {
        if (!run) this.el.prepend(this.final);
        run = appendBlock(this.final, run, b.node);
        done = b.end;
      } else {
        this.el.append(b.node);
        this.open.push(b.node);
      }
    }
    let cut = 0;
    for (let k = 0; k < done; k++) cut = this.tail.indexOf("\n", cut) + 1;
    if (cut) this.tail = this.tail.slice(cut);
    // One open block, an unterminated fence whose opening line is complete: extendFence next.
    if (this.open.length !== 1) return;
    const first = lines.slice(done).findIndex((line) => !isBlank(line)) + done;
    const m = FENCE.exec(lines[first]);
    const code = this.open[0].querySelector?.("pre > code");
    if (m && code && first < lines.length - 1 && end > lines.length) {
      const chunk = code.lastChild;
      const newlines = countNewlines(chunk.textContent);
      this.fence = { marker: m[1], code, chunk, newlines, lineStart: this.tail.lastIndexOf("\n") + 1 };
    }
  }
}

function countNewlines(text) {
  let n = 0;
  for (let at = text.indexOf("\n"); at >= 0; at = text.indexOf("\n", at + 1)) n++;
  return n;
}
