// Markdown to HTML for answers (marked, vendored), made safe: raw HTML is shown as text,
// links only to http(s) and mailto, images as links (nothing is loaded from elsewhere),
// and every code block gets a Copy button.

import { Marked } from "/web/vendor/marked.esm.js";

const ESCAPES = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ESCAPES[c]);
}

function safeUrl(href) {
  return /^(https?:|mailto:)/i.test(href || "") ? href : "";
}

const marked = new Marked({
  gfm: true,
  breaks: false,
  renderer: {
    html({ text }) {
      return escapeHtml(text);
    },
    link({ href, title, tokens }) {
      const text = this.parser.parseInline(tokens);
      const url = safeUrl(href);
      if (!url) return text;
      const t = title ? ` title="${escapeHtml(title)}"` : "";
      return `<a href="${escapeHtml(url)}"${t} target="_blank" rel="noopener noreferrer">${text}</a>`;
    },
    image({ href, text }) {
      const url = safeUrl(href);
      return url ? `<a href="${escapeHtml(url)}" rel="noopener noreferrer">${escapeHtml(text || url)}</a>`
        : escapeHtml(text);
    },
    code({ text, lang }) {
      const language = (lang || "").match(/^\S*/)[0];
      const cls = language ? ` class="language-${escapeHtml(language)}"` : "";
      return `<div class="code"><button type="button" class="copy">Copy</button>` +
        `<pre><code${cls}>${escapeHtml(text)}</code></pre></div>`;
    },
  },
});

export function renderMarkdown(text) {
  return marked.parse(text);
}

// Copy buttons of code blocks under ``root`` copy their block's text.
export function wireCopyButtons(root) {
  root.addEventListener("click", async (event) => {
    const button = event.target.closest("button.copy");
    if (!button) return;
    const code = button.parentElement.querySelector("code").textContent;
    try {
      await navigator.clipboard.writeText(code);
      button.textContent = "Copied";
    } catch {
      button.textContent = "Select and copy";
    }
    setTimeout(() => { button.textContent = "Copy"; }, 1500);
  });
}
